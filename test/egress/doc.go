// Package egress is the egress suite: it starts `space up` from the built
// binaries with a simulated internet (package netsim: hosts in a network
// namespace of their own with HTTP, HTTPS and DNS servers, addresses from
// 198.18.0.0/15) as the workers' upstream, and drives sandboxes' network
// options through the Go SDK: allowed and denied destinations at TCP
// connect, TLS SNI and HTTP Host, wildcards, DNS under an allow-list, DNS
// rebinding, updateNetwork on a live connection, the always-denied
// addresses (the host's loopback services, the control plane, other
// sandboxes, metadata), header transforms with a secret the sandbox never
// sees, and the policy across pause and resume. No packet leaves the
// machine: the simulated internet is a namespace this suite makes.
package egress
