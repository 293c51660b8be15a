"""What the node processes and the router share: proto conversion, status mapping, health, metrics,
node assembly and the local launcher.  Engine logic stays in ``engine/``; the step loop's driver is
``engine/driver.py``."""
