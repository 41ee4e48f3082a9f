package node

import "golang.org/x/sys/unix"

// SealInheritedFDs marks every descriptor above stderr that this process
// inherited close-on-exec, so none reaches what the worker starts
// (sandbox inits, spaced-host, netgtw, QEMU). A shell or supervisor that
// leaves a descriptor open (a terminal, a socket, a log file) would
// otherwise hand it to every sandbox. Call it first in main, before
// anything opens descriptors of its own that children must inherit.
func SealInheritedFDs() {
	_ = unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
}
