// Package cluster holds the cluster fault test (issue 18): SPACE as a
// cluster of hosts on one machine (internal/hostsim network namespaces on
// a bridge): a three-member etcd cluster (Debian's etcd), two space-api,
// two space-edge and three space-node workers, each on a host of its own,
// the workers sharing one snapshot directory. Under continuous client load
// from a host of its own (creates, commands, file writes and reads,
// pause/resume, through both edges and both control planes, with the one
// retry against the other replica a client or load balancer makes), it
// kills and restarts in turn one etcd member, one control plane, one edge
// and one worker, and partitions a worker for 30 s; then it backs etcd up
// from the running cluster and restores it into a fresh one. It reports
// recovery time and error rate per fault, misroutes, requests served by a
// replaced execution, acknowledged writes lost and sandboxes lost (the
// last four must be 0), and asserts two properties of the replicas: an
// edge whose control plane dies asks the other one (no data-plane request
// through it fails on its first attempt), and a partitioned worker's
// sandboxes are served by another worker before the partition heals. `make test` and `make cluster-test` run it, as
// root, on the built binaries (SPACE_BIN_DIR).
package cluster
