package baseimage

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/logsetup"
)

// Command is cmd/space-baseimage: it builds (or, with -lookup, only
// finds) the image its flags describe and prints its ID and directory
// (with -code-interpreter: the stack's ID and its layers, bottom first,
// joined by ':').
// args exclude the program name; getenv supplies the log defaults. It
// returns the exit code.
func Command(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("space-baseimage", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg Config
	var pkgs string
	fs.StringVar(&cfg.CacheDir, "cache-dir", DefaultCacheDir, "directory of built images (root-only)")
	fs.StringVar(&cfg.Mirror, "mirror", DefaultMirror, "Debian archive")
	fs.StringVar(&cfg.Suite, "suite", "", "Debian release (default: the host's)")
	fs.StringVar(&pkgs, "packages", "", "comma-separated packages (default: E2B's base set)")
	lookupOnly := fs.Bool("lookup", false, "only report whether the image is built; never build")
	interp := fs.Bool("code-interpreter", false, "the code interpreter image (the code-interpreter-v1 template: a layer over the base) instead of the base")
	timeout := fs.Duration("timeout", 30*time.Minute, "bound on the build")
	logOpts := logsetup.Flags(fs, logsetup.Options{Format: getenv(logsetup.EnvFormat), Level: getenv(logsetup.EnvLevel)})
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log, err := logsetup.New(stderr, *logOpts)
	if err != nil {
		fmt.Fprintln(stderr, "space-baseimage:", err)
		return 2
	}
	if pkgs != "" {
		cfg.Packages = strings.Split(pkgs, ",")
	}
	if *interp {
		icfg := InterpConfig{Base: cfg}
		var st Stack
		if *lookupOnly {
			st, err = LookupInterp(icfg)
		} else {
			ctx, cancel := context.WithTimeout(ctx, *timeout)
			defer cancel()
			st, err = EnsureInterp(ctx, icfg, log)
		}
		if err != nil {
			fmt.Fprintln(stderr, "space-baseimage:", err)
			return 1
		}
		fmt.Fprintf(stdout, "%s %s\n", st.ID, strings.Join(st.Layers, ":"))
		return 0
	}
	var b Base
	if *lookupOnly {
		b, err = Lookup(cfg)
	} else {
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		b, err = Ensure(ctx, cfg, log)
	}
	if err != nil {
		fmt.Fprintln(stderr, "space-baseimage:", err)
		return 1
	}
	fmt.Fprintf(stdout, "%s %s\n", b.ID, b.Dir)
	return 0
}
