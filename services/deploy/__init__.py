"""Deployments: the inventory of GPU nodes rendered into one docker-compose project per node (``make deploy``).

``inventory`` reads and checks the inventory file, ``render`` turns it into a plan and files (pure),
``apply`` carries them out over ssh, ``devstack`` lists the processes ``poise up`` starts (what
``deploy/docker-compose.yml`` is checked against). ``python -m services.deploy --help`` is the CLI.
"""
