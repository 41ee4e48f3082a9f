// Command spaced-guest is the SPACE in-sandbox agent (envd-compatible API).
// Config: JSON of guest.Config in $SPACE_GUEST_CONFIG (removed from the
// environment once read). Listener: inherited fd 3, or --listen
// unix:/path | tcp:host:port.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spacesbx/space/internal/guest"
)

func main() {
	listen := flag.String("listen", "", "unix:/path or tcp:host:port (default: inherited fd 3)")
	flag.Parse()
	var cfg guest.Config
	if err := json.Unmarshal([]byte(os.Getenv("SPACE_GUEST_CONFIG")), &cfg); err != nil {
		fail("SPACE_GUEST_CONFIG: %v", err)
	}
	_ = os.Unsetenv("SPACE_GUEST_CONFIG")
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	srv, err := guest.New(cfg)
	if err != nil {
		fail("%v", err)
	}
	var l net.Listener
	if network, addr, ok := strings.Cut(*listen, ":"); ok && (network == "unix" || network == "tcp") {
		l, err = net.Listen(network, addr)
	} else if *listen == "" {
		l, err = net.FileListener(os.NewFile(3, "listener"))
	} else {
		err = fmt.Errorf("--listen %q: want unix:/path or tcp:host:port", *listen)
	}
	if err != nil {
		fail("listen: %v", err)
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-sigs; _ = srv.Close() }()
	if err := srv.Serve(l); err != nil {
		fail("serve: %v", err)
	}
	_ = srv.Close() // waits for owned goroutines (no-op if already closed)
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "spaced-guest: "+format+"\n", args...)
	os.Exit(1)
}
