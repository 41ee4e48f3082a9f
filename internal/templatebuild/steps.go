package templatebuild

import (
	"context"
	"errors"
	"fmt"
	"path"
	"strings"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/dockerfile"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/sdk"
)

// Running the steps in the build sandbox: commands, COPY, the start
// command and its ready check.

// lineWriter turns a stream into log lines.
type lineWriter struct {
	level string
	log   func(level, msg string)
	buf   []byte
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	for {
		i := strings.IndexByte(string(w.buf), '\n')
		if i < 0 {
			if len(w.buf) > 4096 {
				w.log(w.level, string(w.buf))
				w.buf = w.buf[:0]
			}
			return len(p), nil
		}
		w.log(w.level, string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
}

func (w *lineWriter) flush() {
	if len(w.buf) > 0 {
		w.log(w.level, string(w.buf))
		w.buf = w.buf[:0]
	}
}

func (b *Builder) run(ctx context.Context, sbx *sdk.Sandbox, cmd, user string, st State, log func(level, msg string)) error {
	out, errw := &lineWriter{level: "info", log: log}, &lineWriter{level: "info", log: log}
	code, err := sbx.Run(ctx, cmd, sdk.RunOptions{User: user, Cwd: st.Workdir, Envs: st.Env, Stdout: out, Stderr: errw})
	out.flush()
	errw.flush()
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("command exited with %d: %s", code, truncate(cmd, 200))
	}
	return nil
}

func (b *Builder) runStep(ctx context.Context, sbx *sdk.Sandbox, s e2bapi.TemplateStep, st *State, log func(level, msg string)) error {
	switch s.Type {
	case "RUN":
		user := st.user()
		if len(s.Args) > 1 && s.Args[1] != "" {
			user = s.Args[1]
		}
		return b.run(ctx, sbx, s.Args[0], user, *st, log)
	case "ENV":
		for i := 0; i+1 < len(s.Args); i += 2 {
			st.Env[s.Args[i]] = s.Args[i+1]
		}
		return nil
	case "WORKDIR":
		if err := b.run(ctx, sbx, "mkdir -p "+dockerfile.ShellQuote(s.Args[0]), st.user(), State{Env: st.Env}, log); err != nil {
			return err
		}
		st.Workdir = s.Args[0]
		return nil
	case "USER":
		// The user must exist in the sandbox; E2B creates it.
		cmd := fmt.Sprintf("id -u %[1]s >/dev/null 2>&1 || useradd -m -s /bin/bash %[1]s", dockerfile.ShellQuote(s.Args[0]))
		if err := b.run(ctx, sbx, cmd, "root", State{Env: st.Env}, log); err != nil {
			return err
		}
		st.User = s.Args[0]
		return nil
	case "COPY":
		return b.copyStep(ctx, sbx, s, *st, log)
	}
	return fmt.Errorf("%w: unknown step type %q", errdefs.ErrInvalid, s.Type)
}

// copyStep unpacks the uploaded tar in the sandbox and copies its src
// to dest there: tar's own path handling runs inside the sandbox, so a
// hostile archive can only write where the sandbox's user may.
func (b *Builder) copyStep(ctx context.Context, sbx *sdk.Sandbox, s e2bapi.TemplateStep, st State, log func(level, msg string)) error {
	rc, err := b.Platform.Files(s.FilesHash)
	if err != nil {
		return fmt.Errorf("files of %s: %w", s.Args[0], err)
	}
	defer rc.Close()
	tmp := "/tmp/.space-copy-" + s.FilesHash[:16]
	if _, err := sbx.WriteFileFrom(ctx, tmp+".tar", rc, sdk.FileOptions{User: "root"}); err != nil {
		return fmt.Errorf("upload %s: %w", s.Args[0], err)
	}
	src, dest := strings.TrimPrefix(path.Clean("/"+s.Args[0]), "/"), s.Args[1]
	user, mode := "", ""
	if len(s.Args) > 2 {
		user = s.Args[2]
	}
	if len(s.Args) > 3 {
		mode = s.Args[3]
	}
	if !path.IsAbs(dest) {
		dest = path.Join(st.Workdir+"/", dest)
		if !path.IsAbs(dest) {
			dest = "/" + dest
		}
	}
	var cmd strings.Builder
	fmt.Fprintf(&cmd, "set -e; t=%s; mkdir -p \"$t\"; tar -xf \"$t.tar\" -C \"$t\" --no-same-owner; rm -f \"$t.tar\"; ", dockerfile.ShellQuote(tmp))
	// Docker's COPY: a destination ending in / (or an existing directory)
	// receives the source inside it; a directory source copies its contents.
	fmt.Fprintf(&cmd, "s=\"$t\"/%s; d=%s; ", dockerfile.ShellQuote(src), dockerfile.ShellQuote(dest))
	cmd.WriteString(`if [ -d "$s" ]; then mkdir -p "$d"; cp -a "$s"/. "$d"/; ` +
		`else case "$d" in */) mkdir -p "$d"; d="$d$(basename "$s")";; *) if [ -d "$d" ]; then d="$d/$(basename "$s")"; else mkdir -p "$(dirname "$d")"; fi;; esac; cp -a "$s" "$d"; fi; `)
	if user != "" {
		fmt.Fprintf(&cmd, "chown -R %s \"$d\"; ", dockerfile.ShellQuote(user))
	}
	if mode != "" {
		fmt.Fprintf(&cmd, "chmod -R %s \"$d\"; ", dockerfile.ShellQuote(mode))
	}
	cmd.WriteString(`rm -rf "$t"`)
	return b.run(ctx, sbx, cmd.String(), "root", State{Env: st.Env}, log)
}

// Start runs job's start command in sbx and waits for its ready command
// (a new sandbox of a template with a start command).
//
// A sandbox restored with its processes (a microVM from the template's
// memory snapshot) serves already: the ready command succeeds at once and
// nothing is started twice.
func (b *Builder) Start(ctx context.Context, sbx *sdk.Sandbox, job Job, st State) error {
	quiet := func(string, string) {}
	if job.ReadyCmd != "" && b.run(ctx, sbx, job.ReadyCmd, st.user(), st, quiet) == nil {
		return nil
	}
	return b.checkStart(ctx, sbx, job, st, quiet)
}

// checkStart starts the start command and waits for the ready command.
func (b *Builder) checkStart(ctx context.Context, sbx *sdk.Sandbox, job Job, st State, log func(level, msg string)) error {
	log("info", "starting: "+truncate(job.StartCmd, 200))
	// No nohup (busybox userlands lack it): without a terminal nothing
	// sends the server a hangup when this shell exits.
	bg := fmt.Sprintf("bash -l -c %s >/tmp/.space-start.log 2>&1 </dev/null &", dockerfile.ShellQuote(job.StartCmd))
	if err := b.run(ctx, sbx, bg, st.user(), st, log); err != nil {
		return fmt.Errorf("start command: %w", err)
	}
	if job.ReadyCmd == "" {
		return nil
	}
	timeout := job.ReadyTimeout
	if timeout <= 0 {
		timeout = 2 * time.Minute
	}
	deadline := time.Now().Add(timeout)
	quiet := func(string, string) {}
	for {
		err := b.run(ctx, sbx, job.ReadyCmd, st.user(), st, quiet)
		if err == nil {
			log("info", "ready: "+truncate(job.ReadyCmd, 200))
			return nil
		}
		if errors.Is(err, context.Canceled) || time.Now().After(deadline) {
			return fmt.Errorf("ready command %q did not succeed within %s: %w", truncate(job.ReadyCmd, 100), timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}
