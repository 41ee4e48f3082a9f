package baseimage

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"
)

// Command is cmd/space-baseimage: it builds (or finds) the image its flags
// describe and prints its ID and directory. args exclude the program name.
func Command(ctx context.Context, args []string, out io.Writer, log *slog.Logger) error {
	fs := flag.NewFlagSet("space-baseimage", flag.ContinueOnError)
	fs.SetOutput(out)
	var cfg Config
	var pkgs string
	fs.StringVar(&cfg.CacheDir, "cache-dir", DefaultCacheDir, "directory of built images (root-only)")
	fs.StringVar(&cfg.Mirror, "mirror", DefaultMirror, "Debian archive")
	fs.StringVar(&cfg.Suite, "suite", "", "Debian release (default: the host's)")
	fs.StringVar(&pkgs, "packages", "", "comma-separated packages (default: E2B's base set)")
	lookupOnly := fs.Bool("lookup", false, "only report whether the image is built; never build")
	timeout := fs.Duration("timeout", 30*time.Minute, "bound on the build")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if pkgs != "" {
		cfg.Packages = strings.Split(pkgs, ",")
	}
	var b Base
	var err error
	if *lookupOnly {
		b, err = Lookup(cfg)
	} else {
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		b, err = Ensure(ctx, cfg, log)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%s %s\n", b.ID, b.Dir)
	return nil
}
