// Command space-baseimage builds the Debian root file system of the
// `base` template into the machine-wide image cache once per content ID
// (make base-image runs it) and prints its ID and directory.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/spacesbx/space/internal/baseimage"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := baseimage.Command(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
