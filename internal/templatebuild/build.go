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
