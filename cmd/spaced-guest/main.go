// Command spaced-guest is the SPACE in-sandbox agent (envd-compatible API).
// Config: JSON of guest.Config in $SPACE_GUEST_CONFIG (unset once read, so
// children do not inherit it). Listener: inherited fd 3, or --listen
// unix:/path | tcp:host:port. User cgroup: the inherited fd named by
// $SPACE_CGROUP_FD (ns substrate; see internal/guest/cgexec), optional.
// SIGTERM/SIGINT: graceful Close.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"

	"github.com/spacesbx/space/internal/guest"
	"github.com/spacesbx/space/internal/guest/cgexec" // also: the wrapper of user commands (its init)
)

// spareThreads is how many OS threads the agent creates at startup and
// keeps (see guest.PrestartThreads).
const spareThreads = 8

func main() {
	listen := flag.String("listen", "", "unix:/path or tcp:host:port (default: inherited fd 3)")
	flag.Parse()
	var cfg guest.Config
	if err := json.Unmarshal([]byte(os.Getenv("SPACE_GUEST_CONFIG")), &cfg); err != nil {
		log.Fatalf("spaced-guest: SPACE_GUEST_CONFIG: %v", err)
	}
	_ = os.Unsetenv("SPACE_GUEST_CONFIG")
	userCgroup, err := cgexec.FromEnv()
	if err != nil {
		log.Fatalf("spaced-guest: %v", err)
	}
	cfg.UserCgroupProcs = userCgroup
	guest.PrestartThreads(spareThreads)
	debug.SetGCPercent(50) // here, not via GOGC: user processes inherit the env

	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if userCgroup != nil {
		warnIfNotExecutableByOthers(cfg.Logger)
	}
	srv, err := guest.New(cfg)
	if err != nil {
		log.Fatalf("spaced-guest: %v", err)
	}
	l, err := listener(*listen)
	if err != nil {
		log.Fatalf("spaced-guest: listen: %v", err)
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-sigs; _ = srv.Close() }()
	if err := srv.Serve(l); err != nil {
		log.Fatalf("spaced-guest: serve: %v", err)
	}
	_ = srv.Close() // waits for the Close started by the signal
}

// listener is the inherited fd 3 (spec ""), or unix:/path or tcp:host:port.
func listener(spec string) (net.Listener, error) {
	if spec == "" {
		return net.FileListener(os.NewFile(3, "listener"))
	}
	network, addr, _ := strings.Cut(spec, ":")
	if network != "unix" && network != "tcp" {
		return nil, fmt.Errorf("--listen %q: want unix:/path or tcp:host:port", spec)
	}
	return net.Listen(network, addr)
}

// warnIfNotExecutableByOthers: the cgexec wrapper re-executes this binary
// as the command's user, so it must be executable by everyone.
func warnIfNotExecutableByOthers(log *slog.Logger) {
	if fi, err := os.Stat("/proc/self/exe"); err == nil && fi.Mode().Perm()&0o001 == 0 {
		log.Warn("spaced-guest: the agent binary is not executable by other users: commands of non-root users will fail to start", "mode", fi.Mode().String())
	}
}
