//go:build linux && amd64

package ns

import (
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"
)

func TestSeccompProgramShape(t *testing.T) {
	p := seccompProgram()
	if len(p) > 4096 {
		t.Fatalf("program too long: %d", len(p))
	}
	if last := p[len(p)-1]; last.Code != bpfRET|bpfK || last.K != seccompRetAllow {
		t.Fatalf("program does not end in allow: %+v", last)
	}
	// Every jump stays inside the program.
	for i, ins := range p {
		if ins.Code&0x07 == bpfJMP {
			if i+1+int(ins.Jt) >= len(p) || i+1+int(ins.Jf) >= len(p) {
				t.Fatalf("instruction %d jumps out of the program", i)
			}
		}
	}
}

// runFilter interprets the subset of classic BPF seccompProgram uses
// against a seccomp_data of (nr, arch, args[0]).
func runFilter(t *testing.T, p []unix.SockFilter, nr, arch uint32, arg0 uint64) uint32 {
	t.Helper()
	var data [64]byte
	binary.LittleEndian.PutUint32(data[offNr:], nr)
	binary.LittleEndian.PutUint32(data[offArch:], arch)
	binary.LittleEndian.PutUint64(data[offArg0Lo:], arg0)
	var acc uint32
	for pc := 0; pc < len(p); pc++ {
		ins := p[pc]
		switch ins.Code {
		case bpfLD | bpfW | bpfABS:
			acc = binary.LittleEndian.Uint32(data[ins.K:])
		case bpfJMP | bpfJEQ | bpfK, bpfJMP | bpfJGE | bpfK, bpfJMP | bpfJSET | bpfK:
			var cond bool
			switch ins.Code &^ (bpfJMP | bpfK) {
			case bpfJEQ:
				cond = acc == ins.K
			case bpfJGE:
				cond = acc >= ins.K
			case bpfJSET:
				cond = acc&ins.K != 0
			}
			if cond {
				pc += int(ins.Jt)
			} else {
				pc += int(ins.Jf)
			}
		case bpfRET | bpfK:
			return ins.K
		default:
			t.Fatalf("unexpected opcode %#x at %d", ins.Code, pc)
		}
	}
	t.Fatal("fell off the program")
	return 0
}

func TestSeccompDecisions(t *testing.T) {
	p := seccompProgram()
	eperm := uint32(seccompRetErrno | uint32(unix.EPERM))
	const i386 = 0x40000003
	cases := []struct {
		name string
		nr   uint32
		arch uint32
		arg0 uint64
		want uint32
	}{
		{"read", unix.SYS_READ, auditArchX86_64, 0, seccompRetAllow},
		{"pidfd_getfd", unix.SYS_PIDFD_GETFD, auditArchX86_64, 0, eperm},
		{"kcmp", unix.SYS_KCMP, auditArchX86_64, 0, eperm},
		{"process_madvise", unix.SYS_PROCESS_MADVISE, auditArchX86_64, 0, eperm},
		{"pidfd_open", unix.SYS_PIDFD_OPEN, auditArchX86_64, 0, seccompRetAllow},
		{"openat", unix.SYS_OPENAT, auditArchX86_64, 0, seccompRetAllow},
		{"i386 abi", 1, i386, 0, seccompRetKillProcess},
		{"x32 abi", x32SyscallBit | unix.SYS_READ, auditArchX86_64, 0, eperm},
		{"mount", unix.SYS_MOUNT, auditArchX86_64, 0, eperm},
		{"unshare", unix.SYS_UNSHARE, auditArchX86_64, unix.CLONE_NEWNS, eperm},
		{"setns", unix.SYS_SETNS, auditArchX86_64, 0, eperm},
		{"ptrace", unix.SYS_PTRACE, auditArchX86_64, 0, eperm},
		{"bpf", unix.SYS_BPF, auditArchX86_64, 0, eperm},
		{"fsopen", unix.SYS_FSOPEN, auditArchX86_64, 0, eperm},
		{"clone3", unix.SYS_CLONE3, auditArchX86_64, 0, seccompRetErrno | uint32(unix.ENOSYS)},
		{"clone thread", unix.SYS_CLONE, auditArchX86_64, unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD, seccompRetAllow},
		{"clone fork", unix.SYS_CLONE, auditArchX86_64, uint64(unix.SIGCHLD), seccompRetAllow},
		{"clone newuser", unix.SYS_CLONE, auditArchX86_64, unix.CLONE_NEWUSER | uint64(unix.SIGCHLD), eperm},
		{"clone newnet", unix.SYS_CLONE, auditArchX86_64, unix.CLONE_NEWNET, eperm},
		{"clone newns", unix.SYS_CLONE, auditArchX86_64, unix.CLONE_NEWNS, eperm},
	}
	for _, c := range cases {
		if got := runFilter(t, p, c.nr, c.arch, c.arg0); got != c.want {
			t.Errorf("%s: got %#x, want %#x", c.name, got, c.want)
		}
	}
}
