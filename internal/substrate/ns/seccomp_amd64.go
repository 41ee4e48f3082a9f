//go:build linux && amd64

package ns

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// BPF and seccomp constants (linux/filter.h, linux/seccomp.h, linux/audit.h).
const (
	bpfLD   = 0x00
	bpfJMP  = 0x05
	bpfRET  = 0x06
	bpfW    = 0x00
	bpfABS  = 0x20
	bpfJEQ  = 0x10
	bpfJGE  = 0x30
	bpfJSET = 0x40
	bpfK    = 0x00

	seccompRetKillProcess = 0x80000000
	seccompRetErrno       = 0x00050000
	seccompRetAllow       = 0x7fff0000

	auditArchX86_64 = 0xc000003e
	x32SyscallBit   = 0x40000000

	offNr     = 0
	offArch   = 4
	offArg0Lo = 16 // args[0], low 32 bits (little endian)

	// CLONE_NEW* flags that clone(2) accepts (CLONE_NEWTIME only works
	// through clone3, which is refused as a whole).
	cloneNewMask = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS |
		unix.CLONE_NEWIPC | unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET
)

// deniedSyscalls fail with EPERM inside a sandbox: they manage mounts,
// namespaces, the kernel, the clock, keys, or another process's memory.
var deniedSyscalls = []uint32{
	unix.SYS_MOUNT, unix.SYS_UMOUNT2, unix.SYS_PIVOT_ROOT,
	unix.SYS_SWAPON, unix.SYS_SWAPOFF, unix.SYS_REBOOT,
	unix.SYS_KEXEC_LOAD, unix.SYS_KEXEC_FILE_LOAD,
	unix.SYS_INIT_MODULE, unix.SYS_FINIT_MODULE, unix.SYS_DELETE_MODULE,
	unix.SYS_BPF, unix.SYS_PERF_EVENT_OPEN,
	unix.SYS_KEYCTL, unix.SYS_ADD_KEY, unix.SYS_REQUEST_KEY,
	unix.SYS_PTRACE, unix.SYS_PROCESS_VM_READV, unix.SYS_PROCESS_VM_WRITEV,
	// Another process's descriptors, memory advice and kernel object
	// identities: root in a sandbox could otherwise take the agent's
	// listener and cgroup file with pidfd_getfd.
	unix.SYS_PIDFD_GETFD, unix.SYS_KCMP, unix.SYS_PROCESS_MADVISE,
	unix.SYS_UNSHARE, unix.SYS_SETNS,
	unix.SYS_OPEN_BY_HANDLE_AT, unix.SYS_NAME_TO_HANDLE_AT,
	unix.SYS_USERFAULTFD, unix.SYS_ACCT,
	unix.SYS_SETTIMEOFDAY, unix.SYS_CLOCK_SETTIME, unix.SYS_CLOCK_ADJTIME, unix.SYS_ADJTIMEX,
	unix.SYS_IOPL, unix.SYS_IOPERM,
	unix.SYS_QUOTACTL, unix.SYS_QUOTACTL_FD, unix.SYS_LOOKUP_DCOOKIE,
	unix.SYS_FSOPEN, unix.SYS_FSCONFIG, unix.SYS_FSMOUNT, unix.SYS_FSPICK,
	unix.SYS_MOVE_MOUNT, unix.SYS_OPEN_TREE, unix.SYS_OPEN_TREE_ATTR, unix.SYS_MOUNT_SETATTR,
	// Beyond the brief: io_uring has been a steady source of kernel bugs
	// and Docker/gVisor/ChromeOS refuse it too.
	unix.SYS_IO_URING_SETUP, unix.SYS_IO_URING_ENTER, unix.SYS_IO_URING_REGISTER,
}

func stmt(code uint16, k uint32) unix.SockFilter { return unix.SockFilter{Code: code, K: k} }
func jump(code uint16, k uint32, jt, jf uint8) unix.SockFilter {
	return unix.SockFilter{Code: code, Jt: jt, Jf: jf, K: k}
}

// seccompProgram builds the sandbox filter:
//   - arch != x86_64: kill the process; x32 syscall numbers: EPERM;
//   - deniedSyscalls: EPERM;
//   - clone3: ENOSYS (libc falls back to clone, whose flags we can check);
//   - clone with any CLONE_NEW* flag: EPERM;
//   - everything else: allow.
func seccompProgram() []unix.SockFilter {
	eperm := seccompRetErrno | uint32(unix.EPERM)
	p := []unix.SockFilter{
		stmt(bpfLD|bpfW|bpfABS, offArch),
		jump(bpfJMP|bpfJEQ|bpfK, auditArchX86_64, 1, 0),
		stmt(bpfRET|bpfK, seccompRetKillProcess),
		stmt(bpfLD|bpfW|bpfABS, offNr),
		jump(bpfJMP|bpfJGE|bpfK, x32SyscallBit, 0, 1),
		stmt(bpfRET|bpfK, eperm),
	}
	for _, nr := range deniedSyscalls {
		p = append(p, jump(bpfJMP|bpfJEQ|bpfK, nr, 0, 1), stmt(bpfRET|bpfK, eperm))
	}
	p = append(p,
		jump(bpfJMP|bpfJEQ|bpfK, unix.SYS_CLONE3, 0, 1),
		stmt(bpfRET|bpfK, seccompRetErrno|uint32(unix.ENOSYS)),
		jump(bpfJMP|bpfJEQ|bpfK, unix.SYS_CLONE, 0, 3),
		stmt(bpfLD|bpfW|bpfABS, offArg0Lo),
		jump(bpfJMP|bpfJSET|bpfK, cloneNewMask, 0, 1),
		stmt(bpfRET|bpfK, eperm),
		stmt(bpfRET|bpfK, seccompRetAllow),
	)
	return p
}

// installSeccomp loads the filter for the calling thread (which then
// execs). PR_SET_NO_NEW_PRIVS must already be set.
func installSeccomp() error {
	prog := seccompProgram()
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if _, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&fprog))); errno != 0 {
		return fmt.Errorf("seccomp: %w", errno)
	}
	return nil
}
