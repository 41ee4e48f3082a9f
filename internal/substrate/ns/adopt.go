//go:build linux

package ns

// Adoption (issue 13): a sandbox outlives the worker process that started
// it (its init clears its parent-death signal once claimed, init.go), and
// the next worker process takes it over with Adopt from the state the
// instance reported (AdoptState), after verifying that what runs is that
// very activation. Nothing of the worker is needed by a running sandbox:
// its layer disk is mounted in its own namespace (a clone of the worker's
// detached mount), its uid range is bound to its init (uidlease), its
// cgroups and socket are on the host, and its init's output pipe is
// opened again through /proc.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/uidlease"
)

var (
	_ substrate.Adopter   = (*Substrate)(nil)
	_ substrate.Adoptable = (*instance)(nil)
)

// adoptStateVersion is adoptState.V; Adopt refuses other versions.
const adoptStateVersion = 1

// fileID names a file (an inode on a device).
type fileID struct {
	Dev uint64 `json:"dev"`
	Ino uint64 `json:"ino"`
}

func fileIDOf(f *os.File) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fileID{}, fmt.Errorf("ns: fstat %s: %w", f.Name(), err)
	}
	return fileID{Dev: st.Dev, Ino: st.Ino}, nil
}

// adoptState is AdoptState's JSON: what Adopt needs to find and verify an
// instance.
type adoptState struct {
	V int `json:"v"`
	// Boot is the boot id: a pid and start time name a process of one
	// boot only.
	Boot string `json:"boot"`
	// PID and Start are the init's host pid and start time (clock ticks
	// after boot, /proc/<pid>/stat field 22).
	PID   int    `json:"pid"`
	Start uint64 `json:"start"`
	// Agent is the executable the init runs (it exec'd Spec.AgentPath;
	// recorded, so an upgrade that replaced that file still adopts the
	// agent that runs).
	Agent fileID `json:"agent"`
	// UIDFirst is the first host uid of the user namespace's range, 0
	// without one.
	UIDFirst uint32 `json:"uidFirst"`
	// CgroupParent and Cgroup name the groups: <parent>/<cgroup> and
	// <parent>/agent.<cgroup>.
	CgroupParent string `json:"cgroupParent"`
	Cgroup       string `json:"cgroup"`
	Socket       string `json:"socket"`
	// Disk: the writable layer is a layer disk (Spec.Dir/layer.img) on
	// the loop device Loop (a hint: Adopt checks what backs it); else the
	// plain directory Spec.Dir/layer.
	Disk bool   `json:"disk"`
	Loop string `json:"loop,omitempty"`
	// Log is the pipe of the init's output (fd 1 and 2).
	Log fileID `json:"log"`
	// Limits are the sandbox's effective limits.
	Limits substrate.Limits `json:"limits"`
}

// recordState sets i's AdoptState once its init runs the agent.
func (s *Substrate) recordState(i *instance) error {
	st := adoptState{V: adoptStateVersion, PID: i.pid, CgroupParent: s.cfg.CgroupParent, Cgroup: i.cgName,
		Socket: i.socket, Log: i.logPipe, Limits: i.lim}
	var err error
	if st.Boot, err = bootID(); err != nil {
		return err
	}
	if st.Start, err = procStart(i.pid); err != nil {
		return err
	}
	if st.Agent, err = exeID(i.pid); err != nil {
		return err
	}
	if i.uids != nil {
		st.UIDFirst = i.uids.First()
	}
	s.layerMu.Lock()
	if ref := s.layers[i.dir]; ref != nil && ref.disk != nil {
		st.Disk, st.Loop = true, ref.disk.Device()
	}
	s.layerMu.Unlock()
	i.state, err = json.Marshal(st)
	return err
}

// AdoptState implements substrate.Adoptable.
func (i *instance) AdoptState() []byte { return i.state }

// Paused reports whether the sandbox's groups are frozen (or freezing:
// a pause cut short by a worker's death still has to be resumed).
func (i *instance) Paused() bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	return !i.stopped && i.cg.frozen()
}

// Detach lets go of the sandbox and leaves it running: the exit watcher
// ends, the output pipe's reading end and the log are closed, the uid
// range keeps its owner tag (uidlease.Lease.Detach) and the layer
// reference is dropped (the sandbox's namespace holds its own clone of
// the layer disk's mount, so closing the worker's detached mount leaves
// the file system in place).
func (i *instance) Detach() {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return
	}
	i.stopped = true
	close(i.detach)
	if i.stopWatch != nil {
		i.stopWatch()
	}
	if i.pidfd != nil {
		_ = i.pidfd.Close() // ends watchPidfd
	}
	if i.logR != nil {
		_ = i.logR.Close() // ends copyLog
	}
	i.wg.Wait()
	if i.cmd != nil && i.cmd.Process != nil {
		_ = i.cmd.Process.Release()
	}
	i.uids.Detach()
	if i.releaseLayer != nil {
		if err := i.releaseLayer(); err != nil {
			i.s.cfg.Logger.Warn("ns: detach: layer", "route", i.route.String(), "err", err)
		}
		i.releaseLayer = nil
	}
	if i.log != nil {
		_ = i.log.Close()
	}
	i.s.setLive(i.cgName, false)
}

// Adopt implements substrate.Adopter: it verifies that the activation of
// spec described by state still runs (the init by pidfd and start time,
// its executable, its cgroups, its guest socket), takes back its uid
// range and its layer, and returns it as an instance like Start's. Any
// failure is ErrNotAdoptable (or ctx's error) and leaves everything as
// it was.
func (s *Substrate) Adopt(ctx context.Context, spec substrate.Spec, state []byte) (substrate.Instance, error) {
	inst, err := s.adopt(ctx, spec, state)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return nil, fmt.Errorf("ns: adopt %s: %w", spec.Route.SandboxID, cerr)
		}
		return nil, fmt.Errorf("ns: adopt %s: %w: %w", spec.Route.SandboxID, substrate.ErrNotAdoptable, err)
	}
	s.cfg.Logger.Debug("ns: sandbox adopted", "route", spec.Route.String(), "pid", inst.pid)
	return inst, nil
}

func (s *Substrate) adopt(ctx context.Context, spec substrate.Spec, state []byte) (_ *instance, err error) {
	if err := validateSpec(&spec); err != nil {
		return nil, err
	}
	var st adoptState
	dec := json.NewDecoder(bytes.NewReader(state))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&st); err != nil {
		return nil, fmt.Errorf("malformed state: %w", err)
	}
	name := spec.Route.SandboxID + "-" + spec.Route.ActivationID
	socket := filepath.Join(spec.Dir, SocketName)
	boot, err := bootID()
	if err != nil {
		return nil, err
	}
	switch {
	case st.V != adoptStateVersion:
		return nil, fmt.Errorf("state version %d, want %d", st.V, adoptStateVersion)
	case st.Boot != boot:
		return nil, errors.New("state of another boot")
	case st.PID <= 1 || st.Start == 0:
		return nil, fmt.Errorf("state names no process (pid %d, start %d)", st.PID, st.Start)
	case st.Cgroup != name || st.Socket != socket:
		return nil, fmt.Errorf("state of another activation (cgroup %q, socket %q)", st.Cgroup, st.Socket)
	case st.CgroupParent != s.cfg.CgroupParent:
		return nil, fmt.Errorf("sandbox of cgroup parent %q, this substrate's is %q", st.CgroupParent, s.cfg.CgroupParent)
	case validateLimits(st.Limits) != nil:
		return nil, fmt.Errorf("state limits: %w", validateLimits(st.Limits))
	}
	// Reserved (as live) until it is adopted or refused, so two Adopts of
	// one sandbox cannot both succeed.
	s.liveMu.Lock()
	live := s.live[name]
	s.live[name] = true
	s.liveMu.Unlock()
	if live {
		return nil, fmt.Errorf("cgroup %s is already run by this substrate", name)
	}
	defer func() {
		if err != nil {
			s.setLive(name, false)
		}
	}()

	// The init: a pidfd first, then its start time, so that a pid reused
	// by another process cannot pass; every /proc/<pid> read below is of
	// that process as long as the pidfd still names a live one at the end.
	pfd, err := unix.PidfdOpen(st.PID, unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("init %d: %w", st.PID, err)
	}
	pidfd := os.NewFile(uintptr(pfd), "pidfd:"+strconv.Itoa(st.PID)) // on the netpoller: it is non-blocking
	defer func() {
		if err != nil {
			pidfd.Close()
		}
	}()
	if pidfdExited(pfd) {
		// Reaped when it is this process's child after all (a sandbox
		// detached and adopted again in one process); else ECHILD.
		var info unix.Siginfo
		_ = unix.Waitid(unix.P_PIDFD, pfd, &info, unix.WEXITED|unix.WNOHANG, nil)
		return nil, fmt.Errorf("init %d has exited", st.PID)
	}
	if start, err := procStart(st.PID); err != nil || start != st.Start {
		return nil, fmt.Errorf("pid %d is not the recorded init (start time %d, recorded %d; %v)", st.PID, start, st.Start, err)
	}
	if err := checkExe(st.PID, st.Agent); err != nil {
		return nil, err
	}
	gs := s.cgroups.groups(st.CgroupParent, name)
	if err := checkCgroups(st.PID, gs); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(socket); err != nil || fi.Mode().Type() != os.ModeSocket {
		return nil, fmt.Errorf("guest socket %s: not a socket (%v)", socket, err)
	}
	if err := pidfdAlive(pidfd); err != nil {
		return nil, fmt.Errorf("init %d: %w", st.PID, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	// Take back what the sandbox holds; undone (the uid range's tag kept)
	// on failure.
	var uids *uidlease.Lease
	if st.UIDFirst != 0 {
		if uids, err = uidlease.Adopt(s.cfg.UIDLockDir, st.UIDFirst, st.PID); err != nil {
			return nil, err
		}
		defer func() {
			if err != nil {
				uids.Detach()
			}
		}()
	}
	releaseLayer, err := s.adoptLayer(spec.Dir, st)
	if err != nil {
		return nil, err
	}
	inst := &instance{s: s, route: spec.Route, dir: spec.Dir, socket: socket, cg: cgroupOf(s.cgroups.v2, gs), cgName: name,
		pid: st.PID, pidfd: pidfd, lim: st.Limits, uids: uids, releaseLayer: releaseLayer, logPipe: st.Log,
		done: make(chan struct{}), detach: make(chan struct{}), copied: make(chan struct{})}
	inst.state, _ = json.Marshal(st)
	inst.log, inst.logR = s.reopenLog(st.PID, st.Log, filepath.Join(spec.Dir, LogName))
	inst.wg.Add(1)
	go inst.watchPidfd()
	if inst.logR != nil {
		inst.wg.Add(1)
		go inst.copyLog()
	} else {
		close(inst.copied)
	}
	return inst, nil
}

// watchPidfd closes done once the adopted init has exited, seen through
// its pidfd on the netpoller (no thread held per sandbox). Closing the
// pidfd (Detach) ends it without closing done.
func (i *instance) watchPidfd() {
	defer i.wg.Done()
	rc, err := i.pidfd.SyscallConn()
	if err != nil {
		return
	}
	exited := false
	err = rc.Read(func(fd uintptr) bool {
		if pidfdExited(int(fd)) {
			exited = true
			// Reaped here when the init is this process's child after
			// all (adopted by the process that started it); otherwise
			// ECHILD, its parent reaps it.
			var info unix.Siginfo
			_ = unix.Waitid(unix.P_PIDFD, int(fd), &info, unix.WEXITED|unix.WNOHANG, nil)
		}
		return exited
	})
	if err == nil && exited {
		close(i.done)
	}
}

// pidfdExited reports whether the process of pidfd has exited (a pidfd
// is readable once it has, zombie or reaped).
func pidfdExited(pidfd int) bool {
	p := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	n, _ := unix.Poll(p, 0)
	return n > 0 && p[0].Revents&(unix.POLLIN|unix.POLLHUP) != 0
}

// pidfdAlive reports whether the process of pidfd still runs.
func pidfdAlive(pidfd *os.File) error {
	rc, err := pidfd.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.PidfdSendSignal(int(fd), 0, nil, 0) }); err != nil {
		return err
	}
	return serr
}

// checkExe verifies that pid runs the recorded agent executable, bound
// at agentMount in its sandbox.
func checkExe(pid int, want fileID) error {
	got, err := exeID(pid)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("init %d runs another executable (%d:%d, recorded %d:%d)", pid, got.Dev, got.Ino, want.Dev, want.Ino)
	}
	// The link shows the path inside the sandbox's mount namespace.
	if p, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || p != agentMount {
		return fmt.Errorf("init %d runs %q, not the agent at %s (%v)", pid, p, agentMount, err)
	}
	return nil
}

// exeID is the identity of pid's executable.
func exeID(pid int) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/exe", pid), &st); err != nil {
		return fileID{}, fmt.Errorf("ns: executable of %d: %w", pid, err)
	}
	return fileID{Dev: st.Dev, Ino: st.Ino}, nil
}

// reopenLog opens the init's output pipe again (through its fd 2, when
// that is still the recorded pipe) and its log file, capped at what is
// left of maxLogSize. Best effort: without them the output is dropped
// (the agent writes to a pipe nobody reads: EPIPE, which it ignores).
func (s *Substrate) reopenLog(pid int, pipe fileID, path string) (*cappedWriter, *os.File) {
	w := &cappedWriter{}
	fail := func(err error) (*cappedWriter, *os.File) {
		s.cfg.Logger.Debug("ns: adopted sandbox's output is not logged", "pid", pid, "err", err)
		return w, nil
	}
	// Checked before it is opened too: opening is not free of effects for
	// every kind of file (a terminal, a FIFO).
	link := fmt.Sprintf("/proc/%d/fd/2", pid)
	var lst unix.Stat_t
	if err := unix.Stat(link, &lst); err != nil || lst.Dev != pipe.Dev || lst.Ino != pipe.Ino || lst.Mode&unix.S_IFMT != unix.S_IFIFO {
		return fail(fmt.Errorf("fd 2 is not the recorded pipe (%v)", err))
	}
	fd, err := unix.Open(link, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	r := os.NewFile(uintptr(fd), "init-output")
	if id, err := fileIDOf(r); err != nil || id != pipe {
		r.Close()
		return fail(fmt.Errorf("fd 2 is not the recorded pipe (%v)", err))
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		r.Close()
		return fail(err)
	}
	w.f, w.left = f, maxLogSize
	if fi, err := f.Stat(); err == nil {
		w.left = max(0, maxLogSize-fi.Size())
	}
	return w, r
}

// procStart is pid's start time (clock ticks after boot).
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// Field 22 counted after the last ')': the command name may hold
	// spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("malformed stat")
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 20 {
		return 0, errors.New("malformed stat")
	}
	return strconv.ParseUint(string(f[19]), 10, 64)
}

// bootID is this boot's id.
func bootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("ns: boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}
