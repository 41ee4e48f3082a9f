// Command attack holds the hostile programs the hostile-workload suite
// (test/hostile) runs inside sandboxes. It is built statically
// (CGO_ENABLED=0), uploaded through the files API and executed as root or
// as the sandbox's user. Every subcommand prints what it tried and what
// the kernel answered, one result a line ("name: ok ..." or
// "name: err <errno name>"), so the test can judge each step; the exit
// status is 0 when the program ran to its end (not whether the attack
// worked: the test decides that from the lines).
package main

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: attack <subcommand> [args]")
		os.Exit(2)
	}
	cmds := map[string]func([]string){
		"tiocsti":    tiocsti,
		"fds":        fds,
		"pidfd":      pidfd,
		"ptmx":       ptmx,
		"ptmx-child": ptmxChild,
		"inotify":    inotify,
		"swap":       swap,
		"connect":    connect,
		"devices":    devices,
		"ns":         namespaces,
		"memhog":     memhog,
		"sid":        sid,
	}
	f, ok := cmds[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "attack: unknown subcommand %q\n", os.Args[1])
		os.Exit(2)
	}
	f(os.Args[2:])
}

// errName is the errno's symbolic name (EPERM), or the error text.
func errName(err error) string {
	var en syscall.Errno
	if errors.As(err, &en) {
		if n := unix.ErrnoName(en); n != "" {
			return n
		}
		return strconv.Itoa(int(en))
	}
	return strings.ReplaceAll(err.Error(), "\n", " ")
}

func report(name string, err error, okDetail string) {
	if err != nil {
		fmt.Printf("%s: err %s\n", name, errName(err))
		return
	}
	fmt.Printf("%s: ok %s\n", name, okDetail)
}

// raiseNofile lifts the soft RLIMIT_NOFILE to the hard limit.
func raiseNofile() uint64 {
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) == nil {
		rl.Cur = rl.Max
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &rl)
	}
	return rl.Cur
}

// tiocsti TEXT: opens /dev/tty (the controlling terminal) and pushes TEXT
// into its input queue one byte at a time with TIOCSTI.
func tiocsti(args []string) {
	text := "echo HOSTILE-TIOCSTI\n"
	if len(args) > 0 {
		text = args[0]
	}
	fd, err := unix.Open("/dev/tty", unix.O_RDWR|unix.O_NOCTTY, 0)
	report("open /dev/tty", err, "")
	if err != nil {
		return
	}
	defer unix.Close(fd)
	n := 0
	var last error
	for i := 0; i < len(text); i++ {
		b := text[i]
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCSTI, uintptr(unsafe.Pointer(&b)))
		if e != 0 {
			last = e
			break
		}
		n++
	}
	report("TIOCSTI", last, fmt.Sprintf("%d bytes", n))
}

// sid prints this process's session and process group ids and its
// parent's, as the sandbox sees them.
func sid(args []string) {
	s, _ := unix.Getsid(0)
	fmt.Printf("pid %d sid %d pgid %d ppid %d\n", os.Getpid(), s, unix.Getpgrp(), os.Getppid())
	if len(args) > 0 {
		d, _ := time.ParseDuration(args[0])
		time.Sleep(d)
	}
}

// fds lists this process's open file descriptors ("fd N -> target"),
// leaving out the descriptor used to read the list. It reads the list with
// raw system calls, so the Go runtime opens nothing of its own (no
// netpoller) that would show up.
func fds(args []string) {
	own, err := unix.Open("/proc/self/fd", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		report("open /proc/self/fd", err, "")
		return
	}
	var list []int
	buf := make([]byte, 8192)
	for {
		n, err := unix.Getdents(own, buf)
		if err != nil {
			report("getdents /proc/self/fd", err, "")
			return
		}
		if n <= 0 {
			break
		}
		_, _, names := unix.ParseDirent(buf[:n], -1, nil)
		for _, name := range names {
			if fd, err := strconv.Atoi(name); err == nil && fd != own {
				list = append(list, fd)
			}
		}
	}
	unix.Close(own)
	var out strings.Builder
	for _, fd := range list {
		b := make([]byte, 4096)
		target := "?"
		if n, err := unix.Readlink("/proc/self/fd/"+strconv.Itoa(fd), b); err == nil {
			target = string(b[:n])
		} else {
			target = "?" + errName(err)
		}
		fmt.Fprintf(&out, "fd %d -> %s\n", fd, target)
	}
	unix.Write(1, []byte(out.String()))
}

// pidfd [PID]: pidfd_open on PID (default 1, the agent), then pidfd_getfd
// of its descriptors 0..15, kcmp against it and process_madvise on it.
func pidfd(args []string) {
	pid := 1
	if len(args) > 0 {
		pid, _ = strconv.Atoi(args[0])
	}
	pfd, err := unix.PidfdOpen(pid, 0)
	report("pidfd_open", err, strconv.Itoa(pfd))
	if err == nil {
		for t := 0; t < 16; t++ {
			fd, err := unix.PidfdGetfd(pfd, t, 0)
			if err == nil {
				target, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
				report(fmt.Sprintf("pidfd_getfd %d", t), nil, target)
				continue
			}
			report(fmt.Sprintf("pidfd_getfd %d", t), err, "")
		}
		// process_madvise(pidfd, iov, 1, MADV_COLD, 0) over a page of
		// the target: the call is refused before the range matters.
		page := make([]byte, 4096)
		iov := unix.Iovec{Base: &page[0], Len: uint64(len(page))}
		_, _, e := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pfd), uintptr(unsafe.Pointer(&iov)), 1, unix.MADV_COLD, 0, 0)
		report("process_madvise", errnoOrNil(e), "")
		// process_mrelease is the other pidfd memory call.
		_, _, e = unix.Syscall(unix.SYS_PROCESS_MRELEASE, uintptr(pfd), 0, 0)
		report("process_mrelease", errnoOrNil(e), "")
		unix.Close(pfd)
	}
	// kcmp(getpid(), PID, KCMP_FILE, 0, 0): compares the two processes'
	// fd 0; needs ptrace read access to PID.
	const kcmpFile = 0
	r, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(os.Getpid()), uintptr(pid), kcmpFile, 0, 0, 0)
	report("kcmp", errnoOrNil(e), strconv.Itoa(int(r)))
	// The older ways at the agent's descriptors.
	target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/3", pid))
	report("readlink /proc/PID/fd/3", err, target)
	f, err := os.Open(fmt.Sprintf("/proc/%d/fd/3", pid))
	report("open /proc/PID/fd/3", err, "")
	if err == nil {
		f.Close()
	}
	f, err = os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	report("open /proc/PID/mem", err, "")
	if err == nil {
		f.Close()
	}
	// Read and write access to the agent's memory: read its first
	// mapping's first bytes (a write would be the same open with O_RDWR).
	f, err = os.OpenFile(fmt.Sprintf("/proc/%d/mem", pid), os.O_RDWR, 0)
	report("open /proc/PID/mem rw", err, "")
	if err == nil {
		var addr uint64
		if maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid)); err == nil {
			start, _, _ := strings.Cut(string(maps), "-")
			addr, _ = strconv.ParseUint(start, 16, 64)
		}
		b := make([]byte, 8)
		_, err = f.ReadAt(b, int64(addr))
		report("read /proc/PID/mem", err, fmt.Sprintf("%x at %#x", b, addr))
		f.Close()
	}
	err = unix.PtraceAttach(pid)
	report("ptrace attach", err, "")
	if err == nil {
		_ = unix.PtraceDetach(pid)
	}
}

func errnoOrNil(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

// ptmx MAX HOLD: takes as many pseudo-terminals as it can (up to MAX) by
// opening /dev/ptmx, in child processes of ~1000 each when the per-process
// file limit is the first to bite; prints "ptys: TOTAL last-error" and
// "holding", then keeps them for HOLD.
func ptmx(args []string) {
	max, hold := 5000, 30*time.Second
	if len(args) > 0 {
		max, _ = strconv.Atoi(args[0])
	}
	if len(args) > 1 {
		hold, _ = time.ParseDuration(args[1])
	}
	exe, _ := os.Executable()
	total, last := 0, "none"
	var children []*exec.Cmd
	for total < max && len(children) < 64 {
		c := exec.Command(exe, "ptmx-child", strconv.Itoa(max-total))
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		out, err := c.StdoutPipe()
		if err != nil {
			last = errName(err)
			break
		}
		if err := c.Start(); err != nil {
			last = "fork " + errName(err)
			break
		}
		children = append(children, c)
		line, _ := bufio.NewReader(out).ReadString('\n')
		var n int
		var e string
		if _, err := fmt.Sscanf(line, "opened %d %s", &n, &e); err != nil {
			last = "child: " + strings.TrimSpace(line)
			break
		}
		total += n
		last = e
		if e != "EMFILE" && e != "ENFILE" {
			break // the pty limit (or max) ended it, not the file table
		}
	}
	fmt.Printf("ptys: %d %s\n", total, last)
	fmt.Println("holding")
	time.Sleep(hold)
	for _, c := range children {
		c.Process.Kill()
		c.Wait()
	}
}

func ptmxChild(args []string) {
	max, _ := strconv.Atoi(args[0])
	raiseNofile()
	n, last := 0, "none"
	for n < max {
		fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY, 0)
		if err != nil {
			last = errName(err)
			break
		}
		_ = fd // kept open
		n++
	}
	fmt.Printf("opened %d %s\n", n, last)
	os.Stdout.Close()
	select {} // hold until killed
}

// inotify MAX HOLD: takes inotify instances until the kernel refuses (or
// MAX), prints "inotify: N last-error" and "holding", keeps them for HOLD.
func inotify(args []string) {
	max, hold := 100000, time.Duration(0)
	if len(args) > 0 {
		max, _ = strconv.Atoi(args[0])
	}
	if len(args) > 1 {
		hold, _ = time.ParseDuration(args[1])
	}
	raiseNofile()
	n, last := 0, "none"
	for n < max {
		if _, err := unix.InotifyInit1(unix.IN_CLOEXEC); err != nil {
			last = errName(err)
			break
		}
		n++
	}
	fmt.Printf("inotify: %d %s\n", n, last)
	fmt.Println("holding")
	time.Sleep(hold)
}

// swap DIR DURATION: in DIR makes 8 pairs of a directory "dN" with 16
// files of 1 KiB and a symlink "lN" to "/", then exchanges the names of
// each pair with renameat2(RENAME_EXCHANGE) as fast as it can for
// DURATION: a host that walks DIR by path meets "dN" as a directory in
// its listing and then follows the symlink that took its place.
func swap(args []string) {
	dir, dur := args[0], 10*time.Second
	if len(args) > 1 {
		dur, _ = time.ParseDuration(args[1])
	}
	const pairs = 8
	for p := 0; p < pairs; p++ {
		d := filepath.Join(dir, fmt.Sprintf("d%d", p))
		if err := os.MkdirAll(d, 0o755); err != nil {
			report("mkdir", err, "")
			return
		}
		for i := 0; i < 16; i++ {
			if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("f%d", i)), make([]byte, 1024), 0o644); err != nil {
				report("write", err, "")
				return
			}
		}
		l := filepath.Join(dir, fmt.Sprintf("l%d", p))
		_ = os.Remove(l)
		if err := os.Symlink("/", l); err != nil {
			report("symlink", err, "")
			return
		}
	}
	fmt.Println("swapping")
	end := time.Now().Add(dur)
	n := 0
	var last error
	for time.Now().Before(end) && last == nil {
		for i := 0; i < 1000; i++ {
			p := i % pairs
			if err := unix.Renameat2(unix.AT_FDCWD, filepath.Join(dir, fmt.Sprintf("d%d", p)), unix.AT_FDCWD,
				filepath.Join(dir, fmt.Sprintf("l%d", p)), unix.RENAME_EXCHANGE); err != nil {
				last = err
				break
			}
			n++
		}
	}
	report("renameat2 RENAME_EXCHANGE", last, fmt.Sprintf("%d swaps", n))
}

// connect ADDR...: dials each TCP address (2 s timeout).
func connect(args []string) {
	for _, a := range args {
		c, err := net.DialTimeout("tcp", a, 2*time.Second)
		if err == nil {
			c.Write([]byte("HOSTILE\n"))
			c.Close()
		}
		report("connect "+a, err, "")
	}
}

// devices: mknod of block and character devices, then opening them and
// the host's sensitive device paths.
func devices(args []string) {
	for _, p := range []string{"/dev/sda", "/dev/vda", "/dev/kmsg", "/dev/mem", "/dev/kmem", "/dev/port", "/dev/nvme0n1", "/dev/loop0", "/dev/fuse", "/dev/kvm"} {
		f, err := os.OpenFile(p, os.O_RDONLY, 0)
		if err == nil {
			f.Close()
		}
		report("open "+p, err, "")
	}
	dir := "/tmp"
	if len(args) > 0 {
		dir = args[0]
	}
	for _, d := range []struct {
		name         string
		mode         uint32
		major, minor uint32
	}{
		{"blk-vda", unix.S_IFBLK, 254, 0},
		{"blk-sda", unix.S_IFBLK, 8, 0},
		{"chr-mem", unix.S_IFCHR, 1, 1},
		{"chr-kmsg", unix.S_IFCHR, 1, 11},
	} {
		p := filepath.Join(dir, d.name)
		_ = os.Remove(p)
		err := unix.Mknod(p, d.mode|0o600, int(unix.Mkdev(d.major, d.minor)))
		report("mknod "+p, err, "")
		if err == nil {
			f, err := os.OpenFile(p, os.O_RDONLY, 0)
			if err == nil {
				b := make([]byte, 16)
				_, rerr := f.Read(b)
				f.Close()
				report("read "+p, rerr, "")
			} else {
				report("open "+p, err, "")
			}
			os.Remove(p)
		}
	}
	// The kernel log through syslog(2) (what dmesg uses).
	buf := make([]byte, 256)
	_, err := unix.Klogctl(unix.SYSLOG_ACTION_READ_ALL, buf)
	report("syslog READ_ALL", err, "")
}

// ns: namespace entry and mounts.
func namespaces(args []string) {
	for _, f := range []struct {
		name string
		flag int
	}{
		{"unshare NEWUSER", unix.CLONE_NEWUSER},
		{"unshare NEWNS", unix.CLONE_NEWNS},
		{"unshare NEWNET", unix.CLONE_NEWNET},
		{"unshare NEWPID", unix.CLONE_NEWPID},
		{"unshare NEWUTS", unix.CLONE_NEWUTS},
		{"unshare NEWIPC", unix.CLONE_NEWIPC},
		{"unshare NEWCGROUP", unix.CLONE_NEWCGROUP},
		{"unshare NEWTIME", 0x80},
	} {
		report(f.name, unix.Unshare(f.flag), "")
	}
	for _, n := range []string{"mnt", "net", "pid", "user", "uts", "ipc", "cgroup"} {
		fd, err := unix.Open("/proc/1/ns/"+n, unix.O_RDONLY, 0)
		if err != nil {
			report("open /proc/1/ns/"+n, err, "")
			continue
		}
		report("setns "+n, unix.Setns(fd, 0), "")
		unix.Close(fd)
	}
	_ = os.MkdirAll("/tmp/hostile-mnt", 0o755)
	report("mount tmpfs", unix.Mount("tmpfs", "/tmp/hostile-mnt", "tmpfs", 0, ""), "")
	report("mount proc", unix.Mount("proc", "/tmp/hostile-mnt", "proc", 0, ""), "")
	report("mount sysfs", unix.Mount("sysfs", "/tmp/hostile-mnt", "sysfs", 0, ""), "")
	report("mount bind /", unix.Mount("/", "/tmp/hostile-mnt", "", unix.MS_BIND, ""), "")
	report("remount / rw", unix.Mount("", "/usr", "", unix.MS_REMOUNT|unix.MS_BIND, ""), "")
	report("umount /proc/sys", unix.Unmount("/proc/sys", unix.MNT_DETACH), "")
	_, err := unix.Fsopen("tmpfs", 0)
	report("fsopen", err, "")
	_, err = unix.OpenTree(unix.AT_FDCWD, "/", unix.OPEN_TREE_CLONE)
	report("open_tree", err, "")
	report("chroot", unix.Chroot("/tmp"), "")
	report("pivot_root", unix.PivotRoot("/tmp", "/tmp"), "")
	report("sethostname", unix.Sethostname([]byte("hostile")), "")
	_, _, e := unix.RawSyscall(unix.SYS_CLONE, uintptr(unix.CLONE_NEWUSER|unix.SIGCHLD), 0, 0)
	if e == 0 {
		fmt.Println("clone NEWUSER: ok")
		os.Exit(0) // only the child gets here with a 0 return; not reached when refused
	}
	report("clone NEWUSER", e, "")
	_, err = unix.Open("/proc/sysrq-trigger", unix.O_WRONLY, 0)
	report("open /proc/sysrq-trigger", err, "")
	report("init_module", unix.InitModule(nil, ""), "")
	_, _, e = unix.Syscall(unix.SYS_BPF, 0, 0, 0)
	report("bpf", errnoOrNil(e), "")
	_, _, e = unix.Syscall6(unix.SYS_PERF_EVENT_OPEN, 0, 0, 0, 0, 0, 0)
	report("perf_event_open", errnoOrNil(e), "")
}

// memhog STEP_MB MAX_MB: allocates and touches memory in STEP_MB chunks
// up to MAX_MB, printing the running total.
func memhog(args []string) {
	step, max := 32, 8192
	if len(args) > 0 {
		step, _ = strconv.Atoi(args[0])
	}
	if len(args) > 1 {
		max, _ = strconv.Atoi(args[1])
	}
	var keep [][]byte
	for total := 0; total < max; total += step {
		b := make([]byte, step<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		keep = append(keep, b)
		fmt.Printf("allocated %d MiB\n", total+step)
	}
	fmt.Println("memhog: not stopped")
	_ = keep
}
