//go:build !amd64

package microvm

// hostTSCKHz is 0 off amd64: the guest kernel calibrates its TSC itself.
func hostTSCKHz() uint64 { return 0 }
