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
		// The cgexec wrapper re-executes this binary as the command's user.
		if fi, err := os.Stat("/proc/self/exe"); err == nil && fi.Mode().Perm()&0o001 == 0 {
			cfg.Logger.Warn("spaced-guest: the agent binary is not executable by other users: commands of non-root users will fail to start", "mode", fi.Mode().String())
		}
	}
	srv, err := guest.New(cfg)
	if err != nil {
		log.Fatalf("spaced-guest: %v", err)
	}
	network, addr, _ := strings.Cut(*listen, ":")
	var l net.Listener
	if *listen == "" {
		l, err = net.FileListener(os.NewFile(3, "listener"))
	} else if network == "unix" || network == "tcp" {
		l, err = net.Listen(network, addr)
	} else {
		log.Fatalf("spaced-guest: --listen %q: want unix:/path or tcp:host:port", *listen)
	}
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
