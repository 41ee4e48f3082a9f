// Package deploycheck checks SPACE's deployment files against the binaries
// they run: systemd units (deploy/systemd), the container image's
// Dockerfile (deploy/container), the Kubernetes manifests
// (deploy/kubernetes) and the configuration reference
// (docs/CONFIGURATION.md). A binary's flags are read from its own -h
// output (HelpFlags), so a flag a file names is one the binary defines
// today. Nothing here runs a cluster: manifests are decoded strictly with
// the official Kubernetes types and checked for what a cluster would
// reject or silently get wrong (selectors, ports, secrets, flags).
//
// Every checker returns the problems it found as errors (nil: none), so a
// test can prove both that the real files pass and that a broken copy is
// rejected.
package deploycheck
