//go:build linux

package ns

// Warm inits. Moving a process into a cgroup (writing cgroup.procs) takes
// the kernel's cgroup_threadgroup_rwsem for writing, which waits for an
// RCU grace period unless a migration happened just before: on the
// machines measured here (cgroup v1) the first write of a Start took 7 to
// 10 ms, most of a sandbox start, spent asleep. So after each Start the
// substrate starts the next sandbox's init ahead of time: created in
// cgroups of a placeholder name ("warm.<random>", never a sandbox's: ids
// are DNS labels), moved into them, and blocked reading its configuration
// (it does nothing before that, as for any init). The next Start whose
// limits are the same claims it: it renames the cgroups to the sandbox's
// names (rename within the parent, cgroup v1), directs the init's output
// to the activation's log, and sends the configuration as usual; a Start
// finding none (or other limits) starts an init itself. At most one warm
// init exists; Close stops it. Only on cgroup v1 (v2 cannot rename; there
// clone3's CLONE_INTO_CGROUP would avoid the migration instead).

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/procwait"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/uidlease"
)

// socketPair returns the two ends of a Unix stream socket pair (CLOEXEC).
func socketPair() (a, b *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("ns: socketpair: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "init-config"), os.NewFile(uintptr(fds[1]), "init-config"), nil
}

// spawned is an init started in its cgroups and waiting for its
// configuration on cfgW; it reports on stR.
type spawned struct {
	inst      *instance
	cfgW, stR *os.File
	// name is the cgroups' current name (without the agent prefix).
	name string
	lim  substrate.Limits
	// warm is set for an init started ahead of its Start.
	warm bool
}

// spawn creates the cgroups <parent>/name (and the agent's), starts an
// init in new namespaces, moves it into them and returns it waiting for
// its configuration. Its output goes to logf (nil: kept until claim). On
// error nothing is left (logf is closed).
func (s *Substrate) spawn(name string, lim substrate.Limits, logf *os.File) (_ *spawned, err error) {
	inst := &instance{s: s, done: make(chan struct{}), detach: make(chan struct{}), copied: make(chan struct{}),
		lim: lim, log: &cappedWriter{f: logf, left: maxLogSize}, cgName: name}
	defer func() {
		if err != nil {
			sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if serr := inst.Stop(sctx); serr != nil {
				s.cfg.Logger.Warn("ns: cleanup after failed init start", "err", serr)
			}
		}
	}()
	// Live before the groups exist: a concurrent Sweep never ends them.
	s.setLive(name, true)
	if inst.cg, err = createCgroup(s.cgroups, s.cfg.CgroupParent, name, lim); err != nil {
		return nil, err
	}
	// The init's output goes through a pipe of this process's own (not
	// exec.Cmd's, whose copying cannot be stopped): Detach closes the
	// reading end and the next worker opens the pipe again (adopt.go).
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("ns: %w", err)
	}
	defer outW.Close()
	defer func() {
		if inst.logR == nil { // not handed to the copier
			outR.Close()
		}
	}()
	if inst.logPipe, err = fileIDOf(outW); err != nil {
		return nil, err
	}
	// The configuration travels over a socket so that descriptors (the
	// user-namespace mounts, userns.go) can go with it.
	cfgR, cfgW, err := socketPair()
	if err != nil {
		return nil, err
	}
	defer cfgR.Close()
	stR, stW, err := os.Pipe()
	if err != nil {
		cfgW.Close()
		return nil, err
	}
	defer stW.Close()
	sp := &spawned{inst: inst, cfgW: cfgW, stR: stR, name: name, lim: lim}
	defer func() {
		if err != nil {
			cfgW.Close()
			stR.Close()
		}
	}()
	userProcs, err := inst.cg.openUserProcs()
	if err != nil {
		return nil, err
	}
	defer userProcs.Close()

	initPath := "/proc/self/exe"
	if s.cfg.InitPath != "" {
		initPath = s.cfg.InitPath
	}
	// The init is executed through a descriptor: in a user namespace it
	// cannot search host directories on the way to the binary.
	initBin, err := os.Open(initPath)
	if err != nil {
		return nil, fmt.Errorf("ns: init binary: %w", err)
	}
	defer initBin.Close()
	attr := &syscall.SysProcAttr{
		Cloneflags: cloneFlags,
		Pdeathsig:  syscall.SIGKILL,
		// A session of its own: no controlling terminal, so nothing in
		// the sandbox can reach the terminal of whoever started the
		// worker (/dev/tty, TIOCSTI).
		Setsid: true,
	}
	if s.userns {
		if inst.uids, err = uidlease.Acquire(s.cfg.UIDLockDir, s.cfg.UIDRangeFirst, s.cfg.UIDRangeCount, usernsSize, uint32(time.Now().UnixNano())); err != nil {
			return nil, fmt.Errorf("ns: %w", err)
		}
		base := int(inst.uids.First())
		attr.Cloneflags |= syscall.CLONE_NEWUSER
		attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: usernsSize}}
		attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: usernsSize}}
		attr.GidMappingsEnableSetgroups = true // su, sudo and the agent set groups
	}
	cmd := &exec.Cmd{
		Path:        "/proc/self/fd/" + strconv.Itoa(initBinaryFD),
		Args:        []string{initArg0},
		Env:         []string{},
		Stdout:      outW,
		Stderr:      outW,
		ExtraFiles:  []*os.File{cfgR, userProcs, stW, initBin}, // fds 3, 4, 5 and 6
		SysProcAttr: attr,
	}
	var startErr error
	if err := s.spawner.Do(func() {
		if inst.uids == nil {
			startErr = cmd.Start()
			return
		}
		// The namespace's owner is the clone's effective uid: the range's
		// first uid, so per-user kernel counts are per sandbox.
		startErr = withThreadEUID(inst.uids.First(), cmd.Start)
	}); err != nil {
		return nil, fmt.Errorf("ns: %w", err)
	}
	if startErr != nil {
		if cmd.Process != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		return nil, fmt.Errorf("launch init: %w", startErr)
	}
	inst.cmd = cmd
	inst.pid = cmd.Process.Pid
	exited, stopWatch := procwait.Exited(inst.pid)
	inst.stopWatch = stopWatch
	inst.logR = outR
	inst.wg.Add(2)
	go inst.wait(exited)
	go inst.copyLog()
	cfgR.Close()
	stW.Close()
	userProcs.Close()
	initBin.Close()
	outW.Close()
	if inst.uids != nil {
		// The range stays leased while the init lives, whether or not
		// this process does (uidlease).
		if err := inst.uids.Bind(inst.pid); err != nil {
			return nil, fmt.Errorf("ns: %w", err)
		}
	}

	// Into the cgroups before the init does anything.
	if err := inst.cg.add(inst.pid); err != nil {
		return nil, err
	}
	return sp, nil
}

// warmPrefix names the cgroups of a warm init until it is claimed.
const warmPrefix = "warm."

// takeWarm returns the warm init if it was started for limits lim, else
// nil (a warm init for other limits is stopped: the next Start makes one
// for the limits now in use).
func (s *Substrate) takeWarm(lim substrate.Limits) *spawned {
	s.warmMu.Lock()
	sp := s.warm
	s.warm = nil
	s.warmMu.Unlock()
	if sp == nil {
		return nil
	}
	if sp.lim != lim {
		go sp.discard()
		return nil
	}
	return sp
}

// prewarm starts a warm init for limits lim in the background, unless one
// exists or is being started, or the substrate is closed.
func (s *Substrate) prewarm(lim substrate.Limits) {
	if s.cgroups.v2 || s.cfg.NoWarmInit {
		return
	}
	s.warmMu.Lock()
	if s.warm != nil || s.warming || s.closed {
		s.warmMu.Unlock()
		return
	}
	s.warming = true
	s.warmMu.Unlock()
	s.warmWG.Add(1)
	go func() {
		defer s.warmWG.Done()
		sp, err := s.spawn(warmPrefix+randHex(8), lim, nil)
		if err == nil {
			sp.warm = true
		} else {
			s.cfg.Logger.Debug("ns: no warm init", "err", err)
		}
		s.warmMu.Lock()
		s.warming = false
		keep := err == nil && !s.closed && s.warm == nil
		if keep {
			s.warm = sp
		}
		s.warmMu.Unlock()
		if err == nil && !keep {
			sp.discard()
		}
	}()
}

// claim makes the warm init the one of the sandbox whose cgroups are
// named name and whose init log is logPath: the cgroups are renamed and
// the output so far (normally none) goes to the log.
func (sp *spawned) claim(name, logPath string) error {
	select {
	case <-sp.inst.done:
		return errors.New("warm init exited")
	default:
	}
	cg := sp.inst.cg
	for i, d := range cg.dirs {
		base := filepath.Base(d)
		nb, ok := strings.CutSuffix(base, sp.name)
		if !ok {
			return fmt.Errorf("warm cgroup %s is not named %s", d, sp.name)
		}
		nd := filepath.Join(filepath.Dir(d), nb+name)
		if err := os.Rename(d, nd); err != nil {
			return fmt.Errorf("rename cgroup: %w", err)
		}
		cg.dirs[i] = nd // what remove() deletes stays accurate
		for _, l := range [][]string{cg.initDirs, cg.freezerDirs} {
			for j := range l {
				if l[j] == d {
					l[j] = nd
				}
			}
		}
		if cg.userDir == d {
			cg.userDir = nd
		}
	}
	sp.inst.s.setLive(sp.name, false)
	sp.inst.s.setLive(name, true)
	sp.name, sp.inst.cgName = name, name
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	sp.inst.log.setFile(logf)
	return nil
}

// discard stops an init that will not be used and removes its cgroups.
func (sp *spawned) discard() {
	sp.cfgW.Close() // the init sees no configuration and exits
	sp.stR.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = sp.inst.Stop(ctx)
}

// dropWarm discards the warm init, if any, and waits for it to be gone
// (its mount namespace, copied from the host's when it was started,
// holds copies of the layer disks mounted then; layer.go). The next Start
// makes another.
func (s *Substrate) dropWarm() {
	s.warmMu.Lock()
	sp := s.warm
	s.warm = nil
	s.warmMu.Unlock()
	if sp != nil {
		sp.discard()
	}
}

// stopWarm stops the warm init (Close).
func (s *Substrate) stopWarm() {
	s.warmMu.Lock()
	s.closed = true
	sp := s.warm
	s.warm = nil
	s.warmMu.Unlock()
	s.warmWG.Wait() // one being started is discarded by its goroutine
	if sp != nil {
		sp.discard()
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
