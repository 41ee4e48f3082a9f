package guest

import (
	"golang.org/x/sys/unix"

	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
)

// spareThreads is how many OS threads the agent creates at startup and
// keeps (see PrestartThreads). In a VM the agent's threads are the guest
// kernel's; in an ns sandbox every thread counts against the host's
// kernel.pid_max (thousands of sandboxes per host), and the agent's own
// cgroup (agent.<sandbox>, a pids reserve the user's processes cannot
// fill) already keeps a fork bomb from starving it, so there it keeps a
// small reserve and runs one P (nsGOMAXPROCS): an idle agent then holds a
// handful of threads instead of a dozen.
const (
	spareThreads   = 8
	nsSpareThreads = 2
	nsGOMAXPROCS   = 1
)

// MainOptions is what cmd/spaced-guest takes from its environment.
type MainOptions struct {
	// Args are the command-line arguments (without the program name).
	Args []string
	// ConfigJSON is the JSON of Config ($SPACE_GUEST_CONFIG; ns mode).
	ConfigJSON string
	// VMPort, when set, selects VM mode: the virtio-serial port name
	// ($SPACE_GUEST_VM_PORT); the configuration then comes from the
	// host's ACTIVATE message and ConfigJSON is ignored.
	VMPort string
	// UserCgroup is the user cgroup's cgroup.procs (cgexec.FromEnv; ns).
	UserCgroup *os.File
	Stderr     io.Writer
}

// Main runs spaced-guest and returns its exit code. ns mode: config from
// ConfigJSON, listener inherited fd 3 or --listen unix:/path|tcp:host:port.
// VM mode: see RunVM. SIGTERM/SIGINT: graceful Close.
func Main(o MainOptions) int {
	fs := flagSet(o.Stderr)
	listen := fs.String("listen", "", "unix:/path or tcp:host:port (default: inherited fd 3)")
	if err := fs.Parse(o.Args); err != nil {
		return 2
	}
	logger := slog.New(slog.NewJSONHandler(o.Stderr, nil))
	fatal := func(format string, a ...any) int {
		fmt.Fprintf(o.Stderr, "spaced-guest: "+format+"\n", a...)
		return 1
	}
	// Before anything can start a command: only 0, 1 and 2 reach user
	// code. The listener (inherited fd 3 unless --listen) and the user
	// cgroup stay open here, close-on-exec.
	var keep []int
	if o.VMPort == "" && *listen == "" {
		keep = append(keep, 3)
	}
	if o.UserCgroup != nil {
		keep = append(keep, int(o.UserCgroup.Fd()))
	}
	if err := SealFDs(keep...); err != nil {
		logger.Warn("spaced-guest: could not seal inherited file descriptors", "err", err)
	}
	// Not dumpable: root in the sandbox has the agent's uid and
	// capabilities, which is all ptrace's access check asks of it for
	// /proc/1/mem, /proc/1/fd and the like; a non-dumpable target also
	// needs CAP_SYS_PTRACE, which no sandbox process has. Commands are
	// dumpable again after their exec.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		logger.Error("spaced-guest: cannot make the agent non-dumpable", "err", err)
		return 1
	}
	// The agent is pid 1: a write to a stderr nobody reads any more must
	// fail with EPIPE, not end the agent and with it the sandbox (Go exits
	// on SIGPIPE from fd 1 or 2 unless the signal is notified). A caught
	// signal is reset to its default at exec, so commands keep SIGPIPE.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	if o.VMPort == "" {
		runtime.GOMAXPROCS(nsGOMAXPROCS) // here, not via GOMAXPROCS: user processes inherit the env
		PrestartThreads(nsSpareThreads)
	} else {
		PrestartThreads(spareThreads)
	}
	debug.SetGCPercent(50) // here, not via GOGC: user processes inherit the env
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if o.VMPort != "" {
		if err := RunVM(ctx, VMConfig{Port: o.VMPort, Base: Config{Logger: logger}}); err != nil {
			return fatal("%v", err)
		}
		return 0
	}
	var cfg Config
	if err := json.Unmarshal([]byte(o.ConfigJSON), &cfg); err != nil {
		return fatal("SPACE_GUEST_CONFIG: %v", err)
	}
	cfg.UserCgroupProcs = o.UserCgroup
	cfg.Logger = logger
	if o.UserCgroup != nil {
		warnIfNotExecutableByOthers(logger)
	}
	srv, err := New(cfg)
	if err != nil {
		return fatal("%v", err)
	}
	l, err := listener(*listen)
	if err != nil {
		return fatal("listen: %v", err)
	}
	go func() { <-ctx.Done(); _ = srv.Close() }()
	if err := srv.Serve(l); err != nil {
		return fatal("serve: %v", err)
	}
	_ = srv.Close() // waits for the Close started by the signal
	return 0
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

func flagSet(out io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("spaced-guest", flag.ContinueOnError)
	fs.SetOutput(out)
	return fs
}
