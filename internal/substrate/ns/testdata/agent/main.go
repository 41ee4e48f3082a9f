// Command agent is a tiny stand-in for spaced-guest used by the ns
// substrate tests. It serves on the listener inherited as fd 3: each
// connection sends one JSON line {"cmd": "...", "uid": N, "timeout_ms": N}
// and receives one JSON line {"out": "...", "code": N} with the combined
// output and exit code of `/bin/sh -c cmd` run as uid:uid. As pid 1 it
// reaps every child; the command's process group is killed when the
// command exits (use setsid to leave something running). With
// SPACE_CGROUP_FD (the ns substrate) commands start in the user group as
// spaced-guest's do (internal/guest/cgexec).
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/spacesbx/space/internal/guest/cgexec"
)

type request struct {
	Cmd       string `json:"cmd"`
	UID       int    `json:"uid"`
	TimeoutMS int    `json:"timeout_ms"`
}

type response struct {
	Out  string `json:"out"`
	Code int    `json:"code"`
}

var userProcs *os.File // cgroup.procs of the user group, nil outside the ns substrate

var (
	mu      sync.Mutex // held across start+register so the reaper never misses a pid
	waiters = map[int]chan syscall.WaitStatus{}
)

func reaper() {
	ch := make(chan os.Signal, 16)
	signal.Notify(ch, syscall.SIGCHLD)
	for range ch {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if err == syscall.EINTR {
				continue
			}
			if err != nil || pid <= 0 {
				break
			}
			mu.Lock()
			if w, ok := waiters[pid]; ok {
				w <- ws
				delete(waiters, pid)
			}
			mu.Unlock()
		}
	}
}

func run(req request) response {
	r, w, err := os.Pipe()
	if err != nil {
		return response{Out: err.Error(), Code: -1}
	}
	home := "/root"
	if req.UID != 0 {
		home = "/home/user"
	}
	env := append(os.Environ(), "HOME="+home)
	attr := &os.ProcAttr{
		Dir:   "/",
		Env:   env,
		Files: []*os.File{nil, w, w},
		Sys: &syscall.SysProcAttr{
			Setpgid:    true,
			Credential: &syscall.Credential{Uid: uint32(req.UID), Gid: uint32(req.UID), Groups: []uint32{}},
		},
	}
	exitCh := make(chan syscall.WaitStatus, 1)
	path, argv := "/bin/sh", []string{"sh", "-c", req.Cmd}
	var h *cgexec.Handoff
	if userProcs != nil {
		if h, err = cgexec.NewHandoff(); err != nil {
			w.Close()
			r.Close()
			return response{Out: err.Error(), Code: -1}
		}
		path, argv = h.Wrap(path, argv)
		attr.Files = append(attr.Files, h.ChildFile())
	}
	mu.Lock()
	p, err := os.StartProcess(path, argv, attr)
	if err == nil {
		waiters[p.Pid] = exitCh
	}
	mu.Unlock()
	w.Close()
	if err == nil && h != nil {
		if err = h.Place(p.Pid, userProcs); err != nil {
			<-exitCh
		}
	} else if h != nil {
		h.Close()
	}
	if err != nil {
		b, _ := io.ReadAll(io.LimitReader(r, 4096))
		r.Close()
		return response{Out: err.Error() + " | wrapper said: " + string(b), Code: -1}
	}
	pid := p.Pid
	p.Release()
	outCh := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(r, 1<<20))
		outCh <- b
		io.Copy(io.Discard, r)
	}()
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	var ws syscall.WaitStatus
	select {
	case ws = <-exitCh:
	case <-time.After(timeout):
		syscall.Kill(-pid, syscall.SIGKILL)
		ws = <-exitCh
	}
	syscall.Kill(-pid, syscall.SIGKILL) // leftovers of the command
	var out []byte
	select {
	case out = <-outCh:
	case <-time.After(2 * time.Second):
	}
	r.Close()
	code := ws.ExitStatus()
	if ws.Signaled() {
		code = 128 + int(ws.Signal())
	}
	return response{Out: string(out), Code: code}
}

func serve(c net.Conn) {
	defer c.Close()
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		return
	}
	var req request
	if err := json.Unmarshal(line, &req); err != nil {
		fmt.Fprintf(c, "%q\n", err.Error())
		return
	}
	b, _ := json.Marshal(run(req))
	c.Write(append(b, '\n'))
}

func main() {
	var err error
	if userProcs, err = cgexec.FromEnv(); err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		os.Exit(1)
	}
	go reaper()
	l, err := net.FileListener(os.NewFile(3, "listener"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		os.Exit(1)
	}
	for {
		c, err := l.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "agent: accept:", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		go serve(c)
	}
}
