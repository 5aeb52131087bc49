"""The migrator: leader-elected loop that asks a migration policy which decode requests to move."""
