"""The researcher's lab: simulations on the in-process bus, experiments and sweeps with their
cache, reports and claim verdicts, datasets and partitions, the demo, the fleet launcher and
the attacks the fault studies send.

Nothing that runs in a factory or the cloud imports it: ``edge_client`` (devices) and
``aggregator`` (base stations, cloud) stand alone, and the lab drives their real roles.
"""
