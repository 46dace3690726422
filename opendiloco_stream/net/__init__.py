"""Networking around hivemind: DHT start and errors, metrics on the DHT, reachability, lifecycle.

* :mod:`.keys`         ``run_key`` (a run's DHT keys) and ``NetError``
* :mod:`.dht`          ``start_dht`` / ``stop_dht``, listen/announce shortcuts, identity, ``quiet_hivemind``
* :mod:`.auth`         the run key: signed DHT records and who may join a group
* :mod:`.routes`       the route keeper: a healed partition does not leave the run split
* :mod:`.metrics`      signed per-peer metrics records (``MetricsPublisher``, ``read_swarm_metrics``)
* :mod:`.reachability` the dial-back service a bootstrap offers, and the dial probe
* :mod:`.doctor`       the preflight checks behind ``opendiloco-stream doctor``
* :mod:`.lifecycle`    process groups, ``GracefulShutdown``, ``kill_process_tree``
* :mod:`.tcp`, :mod:`.distance`  TCP socket options and round-trip probes to the initial peers
* :mod:`.ping`         DHT pings to the swarm's peers: their RTT before any round measured it
* :mod:`.flags`        the network command-line flags, mapped onto ``RunConfig.net``

The package imports nothing above it (transport, algorithm, train, commands); ``keys`` and
``flags`` import no hivemind, so the commands' ``--help`` stays light.
"""
