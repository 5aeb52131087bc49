"""The ``poise`` command: bring the stack up, replay traces, talk to the services."""
