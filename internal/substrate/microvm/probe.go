//go:build linux

package microvm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The accelerator probe. Opening /dev/kvm proves nothing: a paravirtual
// KVM (kvm_pvm) opens, creates VMs and then boots only kernels built as
// its guests (Debian's stops after "Probing EDD"), and a device QEMU's uid
// cannot open fails only once QEMU runs. So each candidate accelerator is
// judged by booting: the guest kernel with a tiny initramfs (busybox and an
// init that prints probeReady), under exactly the QEMU, uid, groups and
// seccomp sandbox a sandbox's VM gets. The first candidate whose guest
// prints the line within its bound is used.

const probeReady = "space-probe: ready"

const probeInit = "#!/bin/busybox sh\n/bin/busybox echo '" + probeReady + "'\n"

// ProbeAttempt is the outcome of booting the probe guest under one
// accelerator.
type ProbeAttempt struct {
	Accel string
	// Err is nil when the guest reached its ready line.
	Err  error
	Took time.Duration
}

func (a ProbeAttempt) String() string {
	if a.Err == nil {
		return fmt.Sprintf("%s: booted in %s", a.Accel, a.Took.Round(time.Millisecond))
	}
	return fmt.Sprintf("%s: %v", a.Accel, a.Err)
}

// probeImage is the probe's uncompressed initramfs.
func probeImage(busybox string) ([]byte, error) {
	var buf bytes.Buffer
	c := newCPIOWriter(&buf)
	for _, d := range []string{"bin", "dev", "proc"} {
		if err := c.Dir(d, 0o755, 0, 0); err != nil {
			return nil, err
		}
	}
	if err := c.CharDev("dev/console", 0o600, 5, 1); err != nil {
		return nil, err
	}
	f, err := os.Open(busybox)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if err := c.File("bin/busybox", 0o755, 0, 0, fi.Size(), f); err != nil {
		return nil, err
	}
	if err := c.Bytes("init", 0o755, []byte(probeInit)); err != nil {
		return nil, err
	}
	if err := c.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// memfdWith returns a sealed memfd holding b, positioned at 0.
func memfdWith(name string, b []byte) (*os.File, error) {
	f, err := newMemfd(name, 0)
	if err != nil {
		return nil, err
	}
	if _, err = f.Write(b); err == nil {
		err = seal(f)
	}
	if err == nil {
		_, err = f.Seek(0, 0)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// probe boots the probe guest under accel and returns nil once it prints
// its ready line, or why it did not within timeout.
func (s *Substrate) probe(ctx context.Context, accel string, timeout time.Duration) (err error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if accel == "kvm" && s.asRoot {
		if err := grantKVM(kvmDevice, s.cfg.KVMGroup, s.cfg.UIDLockDir); err != nil {
			return err
		}
	}
	img, err := probeImage(s.cfg.BusyboxPath)
	if err != nil {
		return fmt.Errorf("probe image: %w", err)
	}
	initrd, err := memfdWith("space-probe-initrd", img)
	if err != nil {
		return fmt.Errorf("probe image: %w", err)
	}
	defer initrd.Close()
	kernel, err := os.Open(s.cfg.KernelPath)
	if err != nil {
		return err
	}
	defer kernel.Close()
	cred, lease, err := s.qemuCredential(accel)
	if err != nil {
		return err
	}
	defer lease.release()
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	defer pr.Close()
	mc := machineFor(accel, s.tscKHz)
	cmd := &exec.Cmd{
		Path: s.cfg.QEMUPath,
		Args: []string{"qemu-system-x86_64",
			"-machine", mc.machine, "-accel", accel, "-cpu", mc.cpu, "-smp", "1", "-m", "128M",
			"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
			"-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con",
			"-kernel", procFD(3), "-initrd", procFD(4),
			"-append", "console=ttyS0 quiet panic=-1 reboot=t pci=off" + mc.appendExtra,
			"-sandbox", qemuSandbox,
		},
		Env: []string{}, Dir: "/", Stdout: pw, Stderr: pw,
		ExtraFiles:  []*os.File{kernel, initrd},
		SysProcAttr: &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL, Setsid: true},
	}
	var startErr error
	if err := s.spawner.Do(func() { startErr = cmd.Start() }); err != nil {
		pw.Close()
		return err
	}
	pw.Close()
	if startErr != nil {
		return fmt.Errorf("launch qemu: %w", startErr)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	ready, readerDone := make(chan struct{}), make(chan struct{})
	defer func() {
		_ = cmd.Process.Kill()
		<-exited
		<-readerDone // QEMU's end of the pipe is closed now
	}()
	var tail tailBuffer
	go func() {
		defer close(readerDone)
		sc := bufio.NewScanner(io.TeeReader(pr, &tail))
		for sc.Scan() {
			if strings.Contains(sc.Text(), probeReady) {
				close(ready)
				break
			}
		}
		_, _ = io.Copy(io.Discard, pr) // until QEMU's end closes
	}()
	select {
	case <-ready:
		return nil
	case werr := <-exited:
		exited <- werr // for the deferred wait
		return fmt.Errorf("qemu exited before the guest was ready (%v): %s", werr, tail.String())
	case <-ctx.Done():
		if out := tail.String(); out != "" {
			return fmt.Errorf("guest not ready within %s; console: %s", timeout, out)
		}
		return fmt.Errorf("guest not ready within %s (no console output)", timeout)
	}
}

// tailBuffer keeps the last 512 bytes written, for error messages.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > 512 {
		t.buf = t.buf[len(t.buf)-512:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(strings.Fields(strings.ToValidUTF8(string(t.buf), "?")), " ")
}

// chooseAccel probes the candidates in order and returns the first that
// boots, with every attempt made. Outcomes are remembered for the life of
// the process (probeMemo): several substrates in one process (a
// single-machine platform, tests) probe a host once, and a running host's
// accelerators do not change under it.
func (s *Substrate) chooseAccel(ctx context.Context, cands []string) (string, []ProbeAttempt) {
	var tries []ProbeAttempt
	for _, a := range cands {
		key := s.probeKey(a)
		probeMemo.Lock()
		prev, ok := probeMemo.m[key]
		probeMemo.Unlock()
		if !ok {
			t0 := time.Now()
			timeout := s.cfg.ProbeTimeout
			if a == "tcg" {
				timeout = s.cfg.ProbeTimeoutTCG
			}
			err := s.probe(ctx, a, timeout)
			prev = ProbeAttempt{Accel: a, Err: err, Took: time.Since(t0)}
			if ctx.Err() == nil && key != "" { // a cancelled probe says nothing about the host
				probeMemo.Lock()
				probeMemo.m[key] = prev
				probeMemo.Unlock()
			}
		}
		tries = append(tries, prev)
		if prev.Err == nil {
			return a, tries
		}
		if ctx.Err() != nil {
			break
		}
	}
	return "", tries
}

var probeMemo = struct {
	sync.Mutex
	m map[string]ProbeAttempt
}{m: map[string]ProbeAttempt{}}

// probeKey names what a probe's outcome depends on: the accelerator, the
// QEMU, kernel and busybox files (by inode, size and mtime), the bounds
// and the credentials QEMU gets.
func (s *Substrate) probeKey(accel string) string {
	key := fmt.Sprintf("%s|%d|%d|%s|%s", accel, s.cfg.KVMGroup, s.cfg.UIDFirst, s.cfg.ProbeTimeout, s.cfg.ProbeTimeoutTCG)
	for _, p := range []string{s.cfg.QEMUPath, s.cfg.KernelPath, s.cfg.BusyboxPath} {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return "" // never memoized: see below
		}
		key += fmt.Sprintf("|%s:%d:%d:%d:%d", p, st.Dev, st.Ino, st.Size, st.Mtim.Nano())
	}
	return key
}

// noAccel starts Unavailable's reason when no probe guest booted.
const noAccel = "no working accelerator"
