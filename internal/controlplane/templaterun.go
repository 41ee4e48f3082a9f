package controlplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/templatebuild"
	"github.com/spacesbx/space/sdk"
)

// Running a template build: the build sandbox's platform side (create,
// snapshot, kill, files, cache) and the records of a build's end.

// runBuild runs one build to its end and records the result.
func (s *Server) runBuild(c caller, b store.TemplateBuildRecord, spec e2bapi.TemplateBuildStartV2, src buildSource, lb *liveBuild) {
	defer func() {
		s.tb.mu.Lock()
		delete(s.tb.live, b.ID)
		s.tb.mu.Unlock()
	}()
	log := s.log.With("template", b.TemplateID, "build", b.ID)
	select {
	case s.tb.sem <- struct{}{}:
		defer func() { <-s.tb.sem }()
	case <-s.ctx.Done():
		s.finishBuild(b, lb, templatebuild.Result{}, nil, errors.New("the control plane stopped before the build ran"))
		return
	}
	s.setBuildStatus(b, e2bapi.BuildBuilding)
	t0 := time.Now()
	sbxs, err := sdk.New(sdk.Config{SandboxURL: s.cfg.SandboxURL})
	if err != nil {
		s.finishBuild(b, lb, templatebuild.Result{}, nil, err)
		return
	}
	bld := &templatebuild.Builder{Platform: &buildPlatform{s: s, c: c, image: src.Image}, Sandboxes: sbxs}
	res, err := bld.Run(s.ctx, templatebuild.Job{From: src.From, FromKey: src.Key, Steps: spec.Steps, Setup: src.Setup,
		StartCmd: spec.StartCmd, ReadyCmd: spec.ReadyCmd, Force: spec.Force, Log: lb.add})
	if err == nil {
		lb.add("info", "finalize", fmt.Sprintf("build finished in %s (%d of %d steps cached)", time.Since(t0).Round(time.Millisecond), res.Cached, len(spec.Steps)))
	}
	log.Info("template build ended", "duration", time.Since(t0), "cached_steps", res.Cached, "err", err)
	s.finishBuild(b, lb, res, src.Image, err)
}

func (s *Server) setBuildStatus(b store.TemplateBuildRecord, status string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = s.updateBuild(ctx, b, func(cur *store.TemplateBuildRecord) { cur.Status, cur.UpdatedAt = status, s.now().UTC() })
}

// updateBuild applies f to build b's current record and writes it,
// reading again when it changed meanwhile.
func (s *Server) updateBuild(ctx context.Context, b store.TemplateBuildRecord, f func(*store.TemplateBuildRecord)) error {
	for range 5 {
		cur, err := s.st.GetTemplateBuild(ctx, b.TemplateID, b.ID)
		if err != nil {
			return err
		}
		f(&cur)
		if _, err := s.st.UpdateTemplateBuild(ctx, cur); !errors.Is(err, errdefs.ErrConflict) {
			return err
		}
	}
	return fmt.Errorf("%w: build %s changed concurrently", errdefs.ErrConflict, b.ID)
}

// finishBuild records a build's end; a ready build's tags move to it.
func (s *Server) finishBuild(b store.TemplateBuildRecord, lb *liveBuild, res templatebuild.Result, image *spacev1.ImageSource, berr error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var spec e2bapi.TemplateBuildStartV2
	_ = json.Unmarshal(b.Spec, &spec)
	now := s.now().UTC()
	err := s.updateBuild(ctx, b, func(cur *store.TemplateBuildRecord) {
		cur.Logs, cur.UpdatedAt, cur.FinishedAt = lb.snapshot(), now, &now
		if berr != nil {
			cur.Status, cur.ReasonMessage, cur.ReasonStep = e2bapi.BuildError, berr.Error(), "base"
			var se *templatebuild.StepError
			if errors.As(berr, &se) {
				cur.ReasonMessage, cur.ReasonStep = se.Err.Error(), se.Step
			}
		} else {
			cur.Status, cur.SnapshotID, cur.Image = e2bapi.BuildReady, res.SnapshotID, image
			cur.Env, cur.Workdir, cur.User = res.Env, res.Workdir, res.User
			cur.StartCmd, cur.ReadyCmd = spec.StartCmd, spec.ReadyCmd
		}
	})
	if err != nil {
		s.log.Warn("recording a template build's end", "build", b.ID, "err", err)
		return
	}
	if berr != nil {
		return
	}
	err = s.updateTemplate(ctx, b.TeamID, b.TemplateID, func(tpl *store.TemplateRecord) error {
		for _, t := range b.Tags {
			tpl.Tags[t] = store.TemplateTag{BuildID: b.ID, CreatedAt: now}
		}
		return nil
	})
	if err != nil {
		s.log.Warn("moving a template's tags to its new build", "build", b.ID, "err", err)
	}
}

// buildPlatform is templatebuild.Platform for one team's build.
type buildPlatform struct {
	s *Server
	c caller
	// image is the OCI image the build sandboxes run on (nil: none).
	image *spacev1.ImageSource
}

func (p *buildPlatform) Start(ctx context.Context, from string, env map[string]string) (string, string, error) {
	timeout := int32(3600)
	// Builds install packages: the build sandbox asks for the internet,
	// which the operator's policy still bounds (always-denied ranges, the
	// team's limits); a team denied egress builds without it.
	internet := true
	req := e2bapi.NewSandbox{TemplateID: from, EnvVars: env, Timeout: &timeout, AllowInternetAccess: &internet}
	snap, err := p.s.resolveSnapshotTemplate(ctx, p.c, &req)
	if err != nil {
		return "", "", err
	}
	cp, err := p.s.validateCreate(p.c, req, true)
	if errors.Is(err, errdefs.ErrDenied) {
		req.AllowInternetAccess = nil
		cp, err = p.s.validateCreate(p.c, req, true)
	}
	if err != nil {
		return "", "", err
	}
	cp.RestoreSnapshot = snap
	cp.Image = p.image
	cp.Metadata = map[string]string{"space.template-build": "true"}
	rec, err := p.s.createSandbox(ctx, p.c, cp)
	if err != nil {
		return "", "", err
	}
	return rec.ID, rec.AccessToken, nil
}

func (p *buildPlatform) Snapshot(ctx context.Context, id string) (string, error) {
	snap, err := p.s.snapshotSandbox(ctx, id, p.c.TeamID, "")
	return snap.ID, err
}

func (p *buildPlatform) Kill(ctx context.Context, id string) error {
	return p.s.killSandbox(ctx, id, p.c.TeamID, "template build done", func(store.SandboxRecord) error { return nil })
}

func (p *buildPlatform) Files(hash string) (io.ReadCloser, error) {
	return os.Open(p.s.filesPath(p.c.TeamID, hash))
}

func (p *buildPlatform) CacheGet(ctx context.Context, key string) (templatebuild.Cached, bool) {
	e, err := p.s.st.GetBuildCache(ctx, p.c.TeamID, key)
	if err != nil {
		return templatebuild.Cached{}, false
	}
	// The snapshot must still exist (a deleted template drops its own).
	if _, err := p.s.st.GetSnapshot(ctx, e.SnapshotID); err != nil {
		return templatebuild.Cached{}, false
	}
	return templatebuild.Cached{SnapshotID: e.SnapshotID, State: templatebuild.State{Env: e.Env, Workdir: e.Workdir, User: e.User}}, true
}

func (p *buildPlatform) CachePut(ctx context.Context, key string, c templatebuild.Cached) error {
	return p.s.st.PutBuildCache(ctx, p.c.TeamID, key, store.BuildCacheEntry{SnapshotID: c.SnapshotID, Env: c.Env,
		Workdir: c.Workdir, User: c.User, CreatedAt: p.s.now().UTC()})
}
