"""Helpers the tests share: starting real peers (:mod:`tests.support.peers`) and the check that a
test which starts one carries the ``network`` marker (:mod:`tests.support.markers`)."""
