"""Networking around hivemind: DHT start and errors, metrics on the DHT, reachability, lifecycle.

* :mod:`.dht`          ``start_dht`` / ``stop_dht``, listen/announce shortcuts, identity, ``run_key``
* :mod:`.routes`       the route keeper: a healed partition does not leave the run split
* :mod:`.metrics`      signed per-peer metrics records (``MetricsPublisher``, ``read_swarm_metrics``)
* :mod:`.reachability` the dial-back service a bootstrap offers, and the dial probe
* :mod:`.doctor`       the preflight checks behind ``opendiloco-stream doctor``
* :mod:`.lifecycle`    process groups, ``GracefulShutdown``, ``kill_process_tree``
* :mod:`.flags`        the network command-line flags, mapped onto ``RunConfig.net``

Submodules import hivemind lazily where they can; importing this package is cheap.
"""
