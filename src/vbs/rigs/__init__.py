"""Development rigs: an embedded single-node Ceph, an embedded PostgreSQL and the test guest.

Imported only by vbs up, the tests and bench/: no service depends on them."""
