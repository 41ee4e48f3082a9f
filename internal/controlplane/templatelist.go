package controlplane

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/templatebuild"
	"github.com/spacesbx/space/sdk"
)

// The read side of template builds: status and logs, aliases, lists and
// tags, deletion, and creating a sandbox from a built template.

// handleBuildStatus is GET /templates/{id}/builds/{buildID}/status.
func (s *Server) handleBuildStatus(w http.ResponseWriter, r *http.Request, c caller) {
	tpl, err := s.findTemplate(r.Context(), c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	b, err := s.st.GetTemplateBuild(r.Context(), tpl.ID, r.PathValue("buildID"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	offset := 0
	if v := r.URL.Query().Get("logsOffset"); v != "" {
		if offset, err = strconv.Atoi(v); err != nil || offset < 0 {
			s.writeError(w, r, fmt.Errorf("%w: logsOffset", errdefs.ErrInvalid))
			return
		}
	}
	logs := b.Logs
	s.tb.mu.Lock()
	lb := s.tb.live[b.ID]
	s.tb.mu.Unlock()
	if lb != nil && b.FinishedAt == nil {
		logs = lb.snapshot()
	}
	out := e2bapi.TemplateBuildInfo{TemplateID: tpl.ID, BuildID: b.ID, Status: b.Status, Logs: []string{}, LogEntries: []e2bapi.BuildLogEntry{}}
	if offset < len(logs) {
		for _, l := range logs[offset:] {
			out.LogEntries = append(out.LogEntries, e2bapi.BuildLogEntry{Timestamp: l.Time, Level: l.Level, Message: l.Message, Step: l.Step})
			out.Logs = append(out.Logs, l.Message)
		}
	}
	if b.Status == e2bapi.BuildError {
		out.Reason = &e2bapi.BuildStatusReason{Message: b.ReasonMessage, Step: b.ReasonStep}
	}
	writeJSON(w, http.StatusOK, out)
}

// handleTemplateSub is GET /templates/aliases/{alias} or GET
// /templates/{id}/tags.
func (s *Server) handleTemplateSub(w http.ResponseWriter, r *http.Request, c caller) {
	switch {
	case r.PathValue("id") == "aliases":
		s.handleTemplateAlias(w, r, c, r.PathValue("sub"))
	case r.PathValue("sub") == "tags":
		s.handleTemplateTags(w, r, c)
	default:
		s.writeError(w, r, fmt.Errorf("%w: no route for %s %s", errdefs.ErrNotFound, r.Method, r.URL.Path))
	}
}

// handleTemplateAlias is GET /templates/aliases/{alias}: platform
// templates and the team's own exist; another team's do not (no 403 that
// would reveal them).
func (s *Server) handleTemplateAlias(w http.ResponseWriter, r *http.Request, c caller, alias string) {
	if _, ok := s.cfg.Templates[alias]; ok {
		writeJSON(w, http.StatusOK, e2bapi.TemplateAliasResponse{TemplateID: alias, Public: true})
		return
	}
	name, _, err := splitTemplateRef(c.TeamID, alias)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: template %q", errdefs.ErrNotFound, truncate(alias, 64)))
		return
	}
	tpl, err := s.findTemplate(r.Context(), c.TeamID, name)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, e2bapi.TemplateAliasResponse{TemplateID: tpl.ID})
}

// handleListTemplates is GET /templates: the platform's templates and the
// team's own.
func (s *Server) handleListTemplates(w http.ResponseWriter, r *http.Request, c caller) {
	out := []e2bapi.Template{}
	for _, id := range slices.Sorted(maps.Keys(s.cfg.Templates)) {
		t := s.cfg.Templates[id]
		out = append(out, e2bapi.Template{TemplateID: id, BuildID: id, CPUCount: t.CPUCount, MemoryMB: t.MemoryMB, DiskSizeMB: t.DiskSizeMB,
			Public: true, Aliases: []string{id}, Names: []string{id}, BuildStatus: e2bapi.BuildReady, BuildCount: 1})
	}
	all, err := s.st.ListTemplates(r.Context())
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	for _, tpl := range all {
		if tpl.TeamID != c.TeamID {
			continue
		}
		builds, _ := s.st.ListTemplateBuilds(r.Context(), tpl.ID)
		e := e2bapi.Template{TemplateID: tpl.ID, Aliases: tpl.Names, Names: qualified(c.TeamID, tpl.Names), CreatedAt: tpl.CreatedAt,
			UpdatedAt: tpl.UpdatedAt, BuildCount: len(builds), BuildStatus: e2bapi.BuildWaiting}
		if len(builds) > 0 {
			last := builds[len(builds)-1]
			e.BuildID, e.BuildStatus = last.ID, last.Status
		}
		base := s.cfg.Templates["base"]
		e.CPUCount, e.MemoryMB, e.DiskSizeMB = base.CPUCount, base.MemoryMB, base.DiskSizeMB
		out = append(out, e)
	}
	writeJSON(w, http.StatusOK, out)
}

// handleGetTemplate is GET /templates/{id}.
func (s *Server) handleGetTemplate(w http.ResponseWriter, r *http.Request, c caller) {
	tpl, err := s.findTemplate(r.Context(), c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	builds, err := s.st.ListTemplateBuilds(r.Context(), tpl.ID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := e2bapi.TemplateWithBuilds{TemplateID: tpl.ID, Aliases: tpl.Names, Names: qualified(c.TeamID, tpl.Names),
		CreatedAt: tpl.CreatedAt, UpdatedAt: tpl.UpdatedAt, Builds: []e2bapi.TemplateBuild{}}
	for _, b := range builds {
		out.Builds = append(out.Builds, e2bapi.TemplateBuild{BuildID: b.ID, Status: b.Status, CreatedAt: b.CreatedAt, UpdatedAt: b.UpdatedAt, FinishedAt: b.FinishedAt})
	}
	writeJSON(w, http.StatusOK, out)
}

// handleTemplateTags is GET /templates/{id}/tags.
func (s *Server) handleTemplateTags(w http.ResponseWriter, r *http.Request, c caller) {
	tpl, err := s.findTemplate(r.Context(), c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := []e2bapi.TemplateTag{}
	for _, t := range slices.Sorted(maps.Keys(tpl.Tags)) {
		out = append(out, e2bapi.TemplateTag{Tag: t, BuildID: tpl.Tags[t].BuildID, CreatedAt: tpl.Tags[t].CreatedAt})
	}
	writeJSON(w, http.StatusOK, out)
}

// handleAssignTags is POST /templates/tags: the build "name:tag" points
// at gets Tags too.
func (s *Server) handleAssignTags(w http.ResponseWriter, r *http.Request, c caller) {
	var req e2bapi.AssignTemplateTagsRequest
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	alias, tag, err := splitTemplateRef(c.TeamID, req.Target)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	for _, t := range req.Tags {
		if !templateTagRE.MatchString(t) {
			s.writeError(w, r, fmt.Errorf("%w: tag %q", errdefs.ErrInvalid, truncate(t, 64)))
			return
		}
	}
	var buildID string
	err = s.updateTemplate(r.Context(), c.TeamID, alias, func(tpl *store.TemplateRecord) error {
		src, ok := tpl.Tags[tag]
		if !ok {
			return fmt.Errorf("%w: %s has no tag %q", errdefs.ErrNotFound, alias, tag)
		}
		buildID = src.BuildID
		for _, t := range req.Tags {
			tpl.Tags[t] = store.TemplateTag{BuildID: src.BuildID, CreatedAt: s.now().UTC()}
		}
		return nil
	})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, e2bapi.AssignedTemplateTags{BuildID: buildID, Tags: req.Tags})
}

// handleDeleteTags is DELETE /templates/tags.
func (s *Server) handleDeleteTags(w http.ResponseWriter, r *http.Request, c caller) {
	var req e2bapi.DeleteTemplateTagsRequest
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	alias, _, err := splitTemplateRef(c.TeamID, req.Name)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	err = s.updateTemplate(r.Context(), c.TeamID, alias, func(tpl *store.TemplateRecord) error {
		for _, t := range req.Tags {
			if _, ok := tpl.Tags[t]; !ok {
				return fmt.Errorf("%w: %s has no tag %q", errdefs.ErrNotFound, alias, t)
			}
			delete(tpl.Tags, t)
		}
		return nil
	})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) updateTemplate(ctx context.Context, team, ref string, f func(*store.TemplateRecord) error) error {
	for range 5 {
		tpl, err := s.findTemplate(ctx, team, ref)
		if err != nil {
			return err
		}
		if tpl.Tags == nil {
			tpl.Tags = map[string]store.TemplateTag{}
		}
		if err := f(&tpl); err != nil {
			return err
		}
		tpl.UpdatedAt = s.now().UTC()
		if _, err := s.st.UpdateTemplate(ctx, tpl); !errors.Is(err, errdefs.ErrConflict) {
			return err
		}
	}
	return fmt.Errorf("%w: template %s changed concurrently", errdefs.ErrConflict, ref)
}

// handleDeleteTemplate is DELETE /templates/{id}: one of the team's built
// templates (its records; the builds' snapshots go with them unless a
// paused sandbox still needs one), else a snapshot (Sandbox.deleteSnapshot).
func (s *Server) handleDeleteTemplate(w http.ResponseWriter, r *http.Request, c caller) {
	tpl, err := s.findTemplate(r.Context(), c.TeamID, r.PathValue("id"))
	if errors.Is(err, errdefs.ErrNotFound) {
		s.handleDeleteSnapshot(w, r, c)
		return
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	builds, _ := s.st.ListTemplateBuilds(r.Context(), tpl.ID)
	for _, b := range builds {
		if b.Status == e2bapi.BuildBuilding || b.Status == e2bapi.BuildWaiting && len(b.Spec) > 0 {
			s.writeError(w, r, fmt.Errorf("%w: template %s has a build running", errdefs.ErrConflict, tpl.ID))
			return
		}
	}
	if err := s.st.DeleteTemplate(r.Context(), tpl.ID); err != nil {
		s.writeError(w, r, err)
		return
	}
	for _, b := range builds {
		if b.SnapshotID == "" {
			continue
		}
		if snap, err := s.st.GetSnapshot(r.Context(), b.SnapshotID); err == nil {
			if err := s.dropSnapshot(r.Context(), snap); err != nil {
				s.log.Warn("dropping a deleted template's snapshot", "template", tpl.ID, "snapshot", snap.ID, "err", err)
			}
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// builtTemplate is a create request's template when it names one of the
// team's built templates.
type builtTemplate struct {
	build store.TemplateBuildRecord
}

// resolveBuiltTemplate turns a create naming one of the team's built
// templates ("alias", "alias:tag", "team/alias" or its id) into a create
// from its build's snapshot; nil when req names something else.
func (s *Server) resolveBuiltTemplate(ctx context.Context, c caller, req *e2bapi.NewSandbox) (*builtTemplate, error) {
	if req.TemplateID == "" || len(req.TemplateID) > 256 {
		return nil, nil
	}
	if _, ok := s.cfg.Templates[req.TemplateID]; ok {
		return nil, nil
	}
	alias, tag, err := splitTemplateRef(c.TeamID, req.TemplateID)
	if err != nil {
		return nil, nil
	}
	tpl, err := s.findTemplate(ctx, c.TeamID, alias)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	b, err := s.taggedBuild(ctx, tpl, tag)
	if err != nil {
		return nil, err
	}
	req.TemplateID = b.SnapshotID
	if len(b.Env) > 0 {
		env := make(map[string]string, len(b.Env)+len(req.EnvVars))
		for k, v := range b.Env {
			env[k] = v
		}
		for k, v := range req.EnvVars {
			env[k] = v
		}
		req.EnvVars = env
	}
	return &builtTemplate{build: b}, nil
}

// startTemplate runs a built template's start command in a new sandbox
// and waits for its ready command (the sandbox is answered only then).
func (s *Server) startTemplate(ctx context.Context, bt *builtTemplate, rec store.SandboxRecord) error {
	if bt == nil || bt.build.StartCmd == "" {
		return nil
	}
	if s.cfg.SandboxURL == "" {
		return fmt.Errorf("%w: template %s has a start command but this control plane has no sandbox URL", errdefs.ErrUnavailable, bt.build.TemplateID)
	}
	cl, err := sdk.New(sdk.Config{SandboxURL: s.cfg.SandboxURL})
	if err != nil {
		return err
	}
	b := &templatebuild.Builder{Sandboxes: cl}
	return b.Start(ctx, cl.Attach(rec.ID, rec.AccessToken), templatebuild.Job{StartCmd: bt.build.StartCmd, ReadyCmd: bt.build.ReadyCmd},
		templatebuild.State{Env: rec.EnvVars, Workdir: bt.build.Workdir, User: bt.build.User})
}
