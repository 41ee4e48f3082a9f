// Package templatebuild runs E2B template builds (Template.build's steps)
// in a build sandbox on the platform itself: it starts a sandbox from the
// parent, runs each step through the sandbox's process and file APIs as
// any client would, and snapshots the sandbox's files after every step.
// A step's snapshot is cached under a hash chained over everything that
// went into it (the parent, every earlier step, the step itself and its
// files' hash), so an unchanged prefix of a template is never run again.
//
// The build sandbox is an ordinary sandbox of the building team: it runs
// under the operator's egress policy and the team's limits, and it is
// isolated as every sandbox is; nothing of a build runs on the host.
package templatebuild

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/sdk"
)

// Platform is what a build needs of the control plane.
type Platform interface {
	// Start creates a build sandbox from from (a platform template or a
	// snapshot id) with env and returns its id and envd access token.
	Start(ctx context.Context, from string, env map[string]string) (id, token string, err error)
	// Snapshot archives the sandbox's files and returns the snapshot id.
	Snapshot(ctx context.Context, id string) (string, error)
	// Kill removes the build sandbox.
	Kill(ctx context.Context, id string) error
	// Files opens the files uploaded for a COPY step under hash (the SDK's
	// tar, gzipped or not).
	Files(hash string) (io.ReadCloser, error)
	// CacheGet and CachePut read and record cached steps.
	CacheGet(ctx context.Context, key string) (Cached, bool)
	CachePut(ctx context.Context, key string, c Cached) error
}

// Cached is a step's result: the files (a snapshot) and the process
// defaults the steps so far set.
type Cached struct {
	SnapshotID string
	State
}

// State is what ENV, WORKDIR and USER steps accumulate.
type State struct {
	Env     map[string]string
	Workdir string
	User    string
}

// Job is one build.
type Job struct {
	// From is where the build starts (a platform template or a snapshot
	// id); FromKey names it for the cache (its content identity: a
	// platform template's version, a parent build's snapshot).
	From, FromKey string
	Steps         []e2bapi.TemplateStep
	// StartCmd and ReadyCmd are checked at the end of the build: the start
	// command must come up and the ready command succeed within
	// ReadyTimeout (the start command is stopped before the snapshot;
	// sandboxes of the template run it at their start).
	StartCmd, ReadyCmd string
	ReadyTimeout       time.Duration
	// Force runs every step, cached or not (skipCache).
	Force bool
	// Setup runs as root in a build sandbox started from From itself (not
	// from a cached step), before the first step: what every template of
	// that parent needs (an OCI image's sandbox user).
	Setup string
	// Log receives the build's output line by line; step is the step's
	// index as the SDK numbers it ("base", "1".., "finalize").
	Log func(level, step, msg string)
}

// Result is a finished build.
type Result struct {
	SnapshotID string
	State
	// Cached counts the steps served from the cache.
	Cached int
}

// StepError is a failed step (Step as in Job.Log).
type StepError struct {
	Step string
	Err  error
}

func (e *StepError) Error() string { return fmt.Sprintf("step %s: %v", e.Step, e.Err) }
func (e *StepError) Unwrap() error { return e.Err }

// Limits on what a build accepts.
const (
	MaxSteps    = 256
	maxArgBytes = 64 << 10
)

// DefaultUser runs steps without a USER (E2B builds run as root until a
// USER step; sandboxes of the template then default to that user).
const DefaultUser = "root"

// Validate checks a build's steps before anything runs.
func Validate(steps []e2bapi.TemplateStep) error {
	if len(steps) > MaxSteps {
		return fmt.Errorf("%w: at most %d steps", errdefs.ErrInvalid, MaxSteps)
	}
	for i, s := range steps {
		n := 0
		for _, a := range s.Args {
			n += len(a)
			if strings.IndexByte(a, 0) >= 0 {
				return fmt.Errorf("%w: step %d: NUL in an argument", errdefs.ErrInvalid, i+1)
			}
		}
		if n > maxArgBytes {
			return fmt.Errorf("%w: step %d: arguments exceed %d bytes", errdefs.ErrInvalid, i+1, maxArgBytes)
		}
		switch s.Type {
		case "RUN":
			if len(s.Args) < 1 || len(s.Args) > 2 || s.Args[0] == "" {
				return fmt.Errorf("%w: step %d: RUN takes a command and an optional user", errdefs.ErrInvalid, i+1)
			}
		case "COPY":
			if len(s.Args) < 2 || s.Args[0] == "" || s.Args[1] == "" || s.FilesHash == "" {
				return fmt.Errorf("%w: step %d: COPY needs a source, a destination and filesHash", errdefs.ErrInvalid, i+1)
			}
			if !validHash(s.FilesHash) {
				return fmt.Errorf("%w: step %d: filesHash must be hex sha256", errdefs.ErrInvalid, i+1)
			}
			if len(s.Args) > 3 && s.Args[3] != "" {
				if _, err := strconv.ParseUint(s.Args[3], 8, 32); err != nil {
					return fmt.Errorf("%w: step %d: COPY mode %q is not octal", errdefs.ErrInvalid, i+1, s.Args[3])
				}
			}
		case "ENV":
			if len(s.Args)%2 != 0 || len(s.Args) == 0 {
				return fmt.Errorf("%w: step %d: ENV takes name/value pairs", errdefs.ErrInvalid, i+1)
			}
			for j := 0; j < len(s.Args); j += 2 {
				if !validEnvName(s.Args[j]) {
					return fmt.Errorf("%w: step %d: ENV name %q", errdefs.ErrInvalid, i+1, s.Args[j])
				}
			}
		case "WORKDIR":
			if len(s.Args) != 1 || !path.IsAbs(s.Args[0]) {
				return fmt.Errorf("%w: step %d: WORKDIR takes one absolute path", errdefs.ErrInvalid, i+1)
			}
		case "USER":
			if len(s.Args) != 1 || !validUser(s.Args[0]) {
				return fmt.Errorf("%w: step %d: USER takes one user name", errdefs.ErrInvalid, i+1)
			}
		default:
			return fmt.Errorf("%w: step %d: unknown step type %q", errdefs.ErrInvalid, i+1, s.Type)
		}
	}
	return nil
}

// ValidHash reports whether h is a hex sha256 (a COPY's filesHash).
func ValidHash(h string) bool { return validHash(h) }

func validHash(h string) bool {
	if len(h) != 64 {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil && strings.ToLower(h) == h
}

func validEnvName(s string) bool {
	if s == "" || len(s) > 256 {
		return false
	}
	for i, c := range s {
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

func validUser(s string) bool {
	if s == "" || len(s) > 32 {
		return false
	}
	for _, c := range s {
		if !(c == '_' || c == '-' || c == '.' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// Key chains the cache key of a step onto the previous one.
func Key(prev string, s e2bapi.TemplateStep) string {
	h := sha256.New()
	b, _ := json.Marshal(struct {
		Prev  string
		Type  string
		Args  []string
		Files string
	}{prev, s.Type, s.Args, s.FilesHash})
	h.Write(b)
	return hex.EncodeToString(h.Sum(nil))
}

// BaseKey is the key the chain starts from.
func BaseKey(fromKey string) string {
	sum := sha256.Sum256([]byte("space-template-base\x00" + fromKey))
	return hex.EncodeToString(sum[:])
}

// Builder runs builds; Sandboxes reaches the build sandboxes' process and
// file APIs (an sdk client with the edge's URL).
type Builder struct {
	Platform  Platform
	Sandboxes *sdk.Client
}

// Run runs job to the end and returns the final snapshot.
func (b *Builder) Run(ctx context.Context, job Job) (Result, error) {
	if err := Validate(job.Steps); err != nil {
		return Result{}, &StepError{Step: "base", Err: err}
	}
	log := job.Log
	if log == nil {
		log = func(string, string, string) {}
	}
	// The longest cached prefix.
	keys := make([]string, len(job.Steps))
	prev := BaseKey(job.FromKey)
	for i, s := range job.Steps {
		prev = Key(prev, s)
		keys[i] = prev
	}
	res := Result{State: State{Env: map[string]string{}}}
	from := job.From
	start := 0
	if !job.Force {
		for i := len(keys) - 1; i >= 0; i-- {
			if job.Steps[i].Force {
				continue
			}
			if c, ok := b.Platform.CacheGet(ctx, keys[i]); ok && !forcedAfter(job.Steps, i) {
				from, start = c.SnapshotID, i+1
				res.State = c.State.clone()
				res.SnapshotID = c.SnapshotID
				res.Cached = i + 1
				break
			}
		}
	}
	for i := 0; i < start; i++ {
		log("info", strconv.Itoa(i+1), fmt.Sprintf("CACHED [%d/%d] %s", i+1, len(job.Steps), describe(job.Steps[i])))
	}
	// The start check is cached too: keyed after the last step.
	startKey := Key(prev, e2bapi.TemplateStep{Type: "START", Args: []string{job.StartCmd, job.ReadyCmd}})
	if start == len(job.Steps) && res.SnapshotID != "" {
		if job.StartCmd == "" {
			return res, nil
		}
		if c, ok := b.Platform.CacheGet(ctx, startKey); ok && !job.Force {
			log("info", "finalize", "CACHED start and ready check")
			res.SnapshotID = c.SnapshotID
			return res, nil
		}
	}
	log("info", "base", "starting the build sandbox from "+from)
	id, token, err := b.Platform.Start(ctx, from, nil)
	if err != nil {
		return res, &StepError{Step: "base", Err: fmt.Errorf("build sandbox: %w", err)}
	}
	defer func() {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := b.Platform.Kill(kctx, id); err != nil {
			log("warn", "finalize", "removing the build sandbox: "+err.Error())
		}
	}()
	sbx := b.Sandboxes.Attach(id, token)
	if job.Setup != "" && start == 0 {
		if err := b.run(ctx, sbx, job.Setup, "root", State{}, func(level, msg string) { log(level, "base", msg) }); err != nil {
			return res, &StepError{Step: "base", Err: fmt.Errorf("setting up the image: %w", err)}
		}
	}
	for i := start; i < len(job.Steps); i++ {
		step := strconv.Itoa(i + 1)
		s := job.Steps[i]
		log("info", step, fmt.Sprintf("[%d/%d] %s", i+1, len(job.Steps), describe(s)))
		if err := b.runStep(ctx, sbx, s, &res.State, func(level, msg string) { log(level, step, msg) }); err != nil {
			return res, &StepError{Step: step, Err: err}
		}
		snap, err := b.Platform.Snapshot(ctx, id)
		if err != nil {
			return res, &StepError{Step: step, Err: fmt.Errorf("snapshot after the step: %w", err)}
		}
		res.SnapshotID = snap
		if err := b.Platform.CachePut(ctx, keys[i], Cached{SnapshotID: snap, State: res.State.clone()}); err != nil {
			log("warn", step, "caching the step: "+err.Error())
		}
	}
	if job.StartCmd != "" {
		if err := b.checkStart(ctx, sbx, job, res.State, func(level, msg string) { log(level, "finalize", msg) }); err != nil {
			return res, &StepError{Step: "finalize", Err: err}
		}
		// The template is the sandbox with its server up: a substrate
		// whose snapshots keep processes (a microVM's memory) starts
		// sandboxes of it with the server already serving.
		snap, err := b.Platform.Snapshot(ctx, id)
		if err != nil {
			return res, &StepError{Step: "finalize", Err: fmt.Errorf("snapshot after the start: %w", err)}
		}
		res.SnapshotID = snap
		if err := b.Platform.CachePut(ctx, startKey, Cached{SnapshotID: snap, State: res.State.clone()}); err != nil {
			log("warn", "finalize", "caching the start check: "+err.Error())
		}
	}
	if res.SnapshotID == "" {
		// No step ran and none was cached: the template is its parent's
		// files.
		snap, err := b.Platform.Snapshot(ctx, id)
		if err != nil {
			return res, &StepError{Step: "finalize", Err: err}
		}
		res.SnapshotID = snap
	}
	return res, nil
}

// forcedAfter reports whether a step after i is forced (its cached
// prefix must not skip it).
func forcedAfter(steps []e2bapi.TemplateStep, i int) bool {
	for _, s := range steps[i+1:] {
		if s.Force {
			return true
		}
	}
	return false
}

func (s State) clone() State {
	return State{Env: maps.Clone(s.Env), Workdir: s.Workdir, User: s.User}
}

func describe(s e2bapi.TemplateStep) string {
	d := s.Type + " " + strings.Join(s.Args, " ")
	if len(d) > 200 {
		d = d[:200] + "..."
	}
	return d
}

func (st State) user() string {
	if st.User != "" {
		return st.User
	}
	return DefaultUser
}

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
		if err := b.run(ctx, sbx, "mkdir -p "+shellQuote(s.Args[0]), st.user(), State{Env: st.Env}, log); err != nil {
			return err
		}
		st.Workdir = s.Args[0]
		return nil
	case "USER":
		// The user must exist in the sandbox; E2B creates it.
		cmd := fmt.Sprintf("id -u %[1]s >/dev/null 2>&1 || useradd -m -s /bin/bash %[1]s", shellQuote(s.Args[0]))
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
	fmt.Fprintf(&cmd, "set -e; t=%s; mkdir -p \"$t\"; tar -xf \"$t.tar\" -C \"$t\" --no-same-owner; rm -f \"$t.tar\"; ", shellQuote(tmp))
	// Docker's COPY: a destination ending in / (or an existing directory)
	// receives the source inside it; a directory source copies its contents.
	fmt.Fprintf(&cmd, "s=\"$t\"/%s; d=%s; ", shellQuote(src), shellQuote(dest))
	cmd.WriteString(`if [ -d "$s" ]; then mkdir -p "$d"; cp -a "$s"/. "$d"/; ` +
		`else case "$d" in */) mkdir -p "$d"; d="$d$(basename "$s")";; *) if [ -d "$d" ]; then d="$d/$(basename "$s")"; else mkdir -p "$(dirname "$d")"; fi;; esac; cp -a "$s" "$d"; fi; `)
	if user != "" {
		fmt.Fprintf(&cmd, "chown -R %s \"$d\"; ", shellQuote(user))
	}
	if mode != "" {
		fmt.Fprintf(&cmd, "chmod -R %s \"$d\"; ", shellQuote(mode))
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
	bg := fmt.Sprintf("bash -l -c %s >/tmp/.space-start.log 2>&1 </dev/null &", shellQuote(job.StartCmd))
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

// shellQuote quotes s for POSIX sh.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
