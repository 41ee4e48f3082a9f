package bridge

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/telemetry"
)

// ReadyLine is written to stdout once the bridge has verified the guest and
// is listening; sbx-manager waits for it.
const ReadyLine = "spaced-host ready"

// Main runs spaced-host with command-line args. It returns the exit code.
//
// tc is the tracing configuration the worker passed (telemetry.Env): with
// an endpoint, spaced-host exports its spans (and the guest's) there.
func Main(args []string, stdout, stderr io.Writer, logOpts logsetup.Options, tc telemetry.Config) int {
	fs := flag.NewFlagSet("spaced-host", flag.ContinueOnError)
	fs.SetOutput(stderr)
	guestSock := fs.String("guest-socket", "", "host path of the agent's Unix socket")
	guestPID := fs.Int("guest-pid", 0, "host pid of the agent process")
	listen := fs.String("listen", "", "Unix socket path to serve sbx-manager on")
	expected := fs.String("expected", "", "expected execution identity (JSON)")
	managerPID := fs.Int("manager-pid", 0, "only accept connections from this pid (0: any)")
	managerFile := fs.String("manager-file", "", "file naming the manager process (pid and start time): a restarted manager takes over by rewriting it")
	channel := fs.String("channel", ChannelUnix, "how the guest is reached: unix (one connection per manager connection) or vmchan (one multiplexed connection to a VMM's chardev socket)")
	activationFile := fs.String("activation-file", "", "vmchan: file holding the ACTIVATE payload (JSON of the guest config)")
	bootTimeout := fs.Duration("boot-timeout", 60*time.Second, "vmchan: how long to wait for the guest to answer the handshake")
	guestExeHash := fs.String("guest-exe-hash", "", "sbx-manager's statement of the SHA-256 of the agent's executable (procid.ExeHash): used only if the guest's executable is exactly that file, unchanged; otherwise it is hashed here")
	argsFromStdin := fs.Bool("args-from-stdin", false, "read the other arguments from the first line of stdin (a JSON array of strings): sbx-manager launches spaced-host before the sandbox it bridges has started")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *argsFromStdin {
		line, err := bufio.NewReader(os.Stdin).ReadBytes('\n')
		if err != nil {
			fmt.Fprintf(stderr, "spaced-host: --args-from-stdin: %v\n", err)
			return 2
		}
		var more []string
		if err := json.Unmarshal(line, &more); err != nil {
			fmt.Fprintf(stderr, "spaced-host: --args-from-stdin: %v\n", err)
			return 2
		}
		if err := fs.Parse(more); err != nil {
			return 2
		}
	}
	if *guestExeHash != "" {
		if err := procid.PrimeExeHash(*guestExeHash); err != nil {
			fmt.Fprintf(stderr, "spaced-host: --guest-exe-hash: %v\n", err)
			return 2
		}
	}
	log, err := logsetup.New(stderr, logOpts)
	if err != nil {
		fmt.Fprintf(stderr, "spaced-host: %v\n", err)
		return 2
	}
	log = log.With("component", "spaced-host")
	var want identity.Route
	if err := json.Unmarshal([]byte(*expected), &want); err != nil {
		fmt.Fprintf(stderr, "spaced-host: --expected: %v\n", err)
		return 2
	}
	log = log.With("sandbox", want.SandboxID, "generation", want.Generation, "worker", want.WorkerID)
	tc.ServiceName = "spaced-host"
	tp, err := telemetry.Setup(context.Background(), tc)
	if err != nil {
		log.Warn("tracing off", "err", err) // a trace collector is never a reason not to serve
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		tp.Shutdown(sctx)
		cancel()
	}()
	var activation []byte
	if *activationFile != "" {
		var err error
		if activation, err = os.ReadFile(*activationFile); err != nil {
			fmt.Fprintf(stderr, "spaced-host: --activation-file: %v\n", err)
			return 2
		}
	}
	b, err := New(Config{GuestSocket: *guestSock, GuestPID: *guestPID, Expected: want, ManagerPID: *managerPID, ManagerFile: *managerFile, Logger: log,
		Channel: *channel, Activation: activation, BootTimeout: *bootTimeout})
	if err != nil {
		log.Error("refusing to start", "err", err)
		return 1
	}
	os.Remove(*listen)
	l, err := net.Listen("unix", *listen)
	if err != nil {
		log.Error("listen", "err", err)
		return 1
	}
	os.Chmod(*listen, 0o600)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- b.Serve(l) }()
	guestGone, gerr := b.GuestExited()
	if gerr != nil {
		guestGone = nil // no pidfds: the manager stops the bridge
	}
	fmt.Fprintln(stdout, ReadyLine)
	select {
	case err = <-done:
	case <-guestGone:
		log.Info("the sandbox's process exited; stopping")
		b.Close()
		<-done
		err = nil
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		b.Shutdown(sctx)
		cancel()
		b.Close()
		err = <-done
	}
	if err != nil {
		log.Error("serve", "err", err)
		return 1
	}
	return 0
}
