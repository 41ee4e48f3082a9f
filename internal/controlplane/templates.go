package controlplane

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/templatebuild"
)

// Template builds (E2B's Template.build): a build request makes a
// template record (by alias, per team) and a waiting build; the SDK
// uploads its COPY files by hash through signed links, then starts the
// build, which runs in a build sandbox (internal/templatebuild) and ends
// in a snapshot. Creating a sandbox from the template restores that
// snapshot on the base template and, when the template has a start
// command, starts it and waits for its ready command before answering.

// maxBuildLogs bounds the log lines a build keeps.
const maxBuildLogs = 5000

// uploadLinkTTL is how long a file upload link is valid.
const uploadLinkTTL = time.Hour

var (
	templateAliasRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,127}$`)
	templateTagRE   = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
)

// templateBuilds is the control plane's running builds.
type templateBuilds struct {
	uploadKey []byte
	sem       chan struct{}

	mu   sync.Mutex
	live map[string]*liveBuild // by build id
}

// uploadKeyName names the cluster key of upload links (store.InitClusterKey).
const uploadKeyName = "template-upload-links"

func newTemplateBuilds(cfg Config, uploadKey []byte) *templateBuilds {
	return &templateBuilds{uploadKey: uploadKey, sem: make(chan struct{}, cfg.BuildConcurrency), live: map[string]*liveBuild{}}
}

// liveBuild is a build running here: its log grows in memory and is
// written to the record when the build ends.
type liveBuild struct {
	mu   sync.Mutex
	logs []store.BuildLog
}

func (l *liveBuild) add(level, step, msg string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(msg) > 4096 {
		msg = msg[:4096] + "..."
	}
	if len(l.logs) >= maxBuildLogs {
		copy(l.logs, l.logs[1:]) // keep the newest: a failure's output is at the end
		l.logs = l.logs[:len(l.logs)-1]
	}
	l.logs = append(l.logs, store.BuildLog{Time: time.Now().UTC(), Level: level, Message: msg, Step: step})
}

func (l *liveBuild) snapshot() []store.BuildLog {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.logs)
}

// splitTemplateRef splits "alias:tag" (tag default "default"), dropping a
// "team/" prefix of the caller's own team.
func splitTemplateRef(team, ref string) (alias, tag string, err error) {
	if i := strings.IndexByte(ref, '/'); i >= 0 {
		if ref[:i] != team {
			return "", "", fmt.Errorf("%w: template %q", errdefs.ErrNotFound, truncate(ref, 64))
		}
		ref = ref[i+1:]
	}
	alias, tag, _ = strings.Cut(ref, ":")
	if tag == "" {
		tag = "default"
	}
	if !templateAliasRE.MatchString(alias) {
		return "", "", fmt.Errorf("%w: template name %q: lower-case letters, digits, '.', '_' and '-', at most 128", errdefs.ErrInvalid, truncate(alias, 64))
	}
	if !templateTagRE.MatchString(tag) {
		return "", "", fmt.Errorf("%w: tag %q", errdefs.ErrInvalid, truncate(tag, 64))
	}
	return alias, tag, nil
}

// findTemplate returns team's template with id or alias ref.
func (s *Server) findTemplate(ctx context.Context, team, ref string) (store.TemplateRecord, error) {
	if rec, err := s.st.GetTemplate(ctx, ref); err == nil {
		if rec.TeamID != team {
			return store.TemplateRecord{}, fmt.Errorf("%w: template %s", errdefs.ErrNotFound, ref)
		}
		return rec, nil
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return store.TemplateRecord{}, err
	}
	all, err := s.st.ListTemplates(ctx)
	if err != nil {
		return store.TemplateRecord{}, err
	}
	for _, rec := range all {
		if rec.TeamID == team && slices.Contains(rec.Names, ref) {
			return rec, nil
		}
	}
	return store.TemplateRecord{}, fmt.Errorf("%w: template %q", errdefs.ErrNotFound, truncate(ref, 64))
}

// handleRequestBuild is POST /v3/templates.
func (s *Server) handleRequestBuild(w http.ResponseWriter, r *http.Request, c caller) {
	var req e2bapi.TemplateBuildRequestV3
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	alias, tag, err := splitTemplateRef(c.TeamID, req.Name)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, ok := s.cfg.Templates[alias]; ok {
		s.writeError(w, r, fmt.Errorf("%w: %q is a platform template; choose another name", errdefs.ErrConflict, alias))
		return
	}
	tags := []string{tag}
	for _, t := range req.Tags {
		if !templateTagRE.MatchString(t) {
			s.writeError(w, r, fmt.Errorf("%w: tag %q", errdefs.ErrInvalid, truncate(t, 64)))
			return
		}
		if !slices.Contains(tags, t) {
			tags = append(tags, t)
		}
	}
	ctx := r.Context()
	now := s.now().UTC()
	tpl, err := s.findTemplate(ctx, c.TeamID, alias)
	if errors.Is(err, errdefs.ErrNotFound) {
		tpl = store.TemplateRecord{ID: "tpl-" + randHex(10), TeamID: c.TeamID, Names: []string{alias}, CreatedAt: now, UpdatedAt: now}
		err = s.st.CreateTemplate(ctx, tpl)
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.CPUCount != nil || req.MemoryMB != nil {
		base := s.cfg.Templates["base"]
		cpu, mem := base.CPUCount, base.MemoryMB
		if req.CPUCount != nil {
			cpu = *req.CPUCount
		}
		if req.MemoryMB != nil {
			mem = *req.MemoryMB
		}
		if cpu < 1 || cpu > 64 || mem < 128 || mem > 256<<10 {
			s.writeError(w, r, fmt.Errorf("%w: cpuCount 1..64 and memoryMB 128..262144", errdefs.ErrInvalid))
			return
		}
	}
	b := store.TemplateBuildRecord{ID: "bld-" + randHex(10), TemplateID: tpl.ID, TeamID: c.TeamID, Status: e2bapi.BuildWaiting,
		Tags: tags, CreatedAt: now, UpdatedAt: now}
	if err := s.st.CreateTemplateBuild(ctx, b); err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusAccepted, e2bapi.TemplateRequestResponseV3{TemplateID: tpl.ID, BuildID: b.ID,
		Aliases: tpl.Names, Names: qualified(c.TeamID, tpl.Names), Tags: tags})
}

func qualified(team string, names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = team + "/" + n
	}
	return out
}

// filesPath is where the files uploaded under hash for team are kept.
func (s *Server) filesPath(team, hash string) string {
	return filepath.Join(s.cfg.TemplateFilesDir, team, hash+".tar")
}

func (s *Server) uploadSig(team, hash string, exp int64) string {
	m := hmac.New(sha256.New, s.tb.uploadKey)
	fmt.Fprintf(m, "%s\x00%s\x00%d", team, hash, exp)
	return hex.EncodeToString(m.Sum(nil))
}

// handleFileUploadLink is GET /templates/{id}/files/{hash}.
func (s *Server) handleFileUploadLink(w http.ResponseWriter, r *http.Request, c caller) {
	hash := r.PathValue("hash")
	if !templatebuild.ValidHash(hash) {
		s.writeError(w, r, fmt.Errorf("%w: files hash must be hex sha256", errdefs.ErrInvalid))
		return
	}
	if _, err := s.findTemplate(r.Context(), c.TeamID, r.PathValue("id")); err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := os.Stat(s.filesPath(c.TeamID, hash)); err == nil {
		writeJSON(w, http.StatusCreated, e2bapi.TemplateBuildFileUpload{Present: true})
		return
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	exp := s.now().Add(uploadLinkTTL).Unix()
	u := fmt.Sprintf("%s://%s/template-files/%s/%s?exp=%d&sig=%s", scheme, r.Host, c.TeamID, hash, exp, s.uploadSig(c.TeamID, hash, exp))
	writeJSON(w, http.StatusCreated, e2bapi.TemplateBuildFileUpload{Present: false, URL: &u})
}

// handleFileUpload is the PUT of a signed upload link: the archive is
// kept by hash for the team (written whole, then renamed into place).
func (s *Server) handleFileUpload(w http.ResponseWriter, r *http.Request) {
	team, hash := r.PathValue("team"), r.PathValue("hash")
	exp, err := strconv.ParseInt(r.URL.Query().Get("exp"), 10, 64)
	want := s.uploadSig(team, hash, exp)
	if err != nil || !templatebuild.ValidHash(hash) || !hmac.Equal([]byte(want), []byte(r.URL.Query().Get("sig"))) {
		s.writeError(w, r, fmt.Errorf("%w: upload link is not valid", errdefs.ErrDenied))
		return
	}
	if s.now().Unix() > exp {
		s.writeError(w, r, fmt.Errorf("%w: upload link expired", errdefs.ErrDenied))
		return
	}
	dst := s.filesPath(team, hash)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	f, err := os.CreateTemp(filepath.Dir(dst), ".upload-*")
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	defer os.Remove(f.Name())
	body := http.MaxBytesReader(w, r.Body, s.cfg.MaxTemplateFileBytes)
	_, err = io.Copy(f, body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			s.writeError(w, r, fmt.Errorf("%w: upload exceeds %d bytes", errdefs.ErrInvalid, s.cfg.MaxTemplateFileBytes))
			return
		}
		s.writeError(w, r, fmt.Errorf("%w: upload: %v", errdefs.ErrUnavailable, err))
		return
	}
	if err := os.Rename(f.Name(), dst); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	w.WriteHeader(http.StatusOK)
}

// handleStartBuild is POST /v2/templates/{id}/builds/{buildID}.
func (s *Server) handleStartBuild(w http.ResponseWriter, r *http.Request, c caller) {
	var spec e2bapi.TemplateBuildStartV2
	if err := decodeJSON(w, r, &spec, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	ctx := r.Context()
	tpl, err := s.findTemplate(ctx, c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	b, err := s.st.GetTemplateBuild(ctx, tpl.ID, r.PathValue("buildID"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if b.Status != e2bapi.BuildWaiting || len(b.Spec) > 0 {
		s.writeError(w, r, fmt.Errorf("%w: build %s was started already", errdefs.ErrConflict, b.ID))
		return
	}
	if err := templatebuild.Validate(spec.Steps); err != nil {
		s.writeError(w, r, err)
		return
	}
	parent, err := s.buildParent(ctx, c.TeamID, tpl.ID, spec)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	for i, st := range spec.Steps {
		if st.Type == "COPY" {
			if _, err := os.Stat(s.filesPath(c.TeamID, st.FilesHash)); err != nil {
				s.writeError(w, r, fmt.Errorf("%w: step %d: files %s were not uploaded", errdefs.ErrInvalid, i+1, st.FilesHash))
				return
			}
		}
	}
	if s.cfg.SandboxURL == "" {
		s.writeError(w, r, fmt.Errorf("%w: template builds are not configured on this control plane (no sandbox URL)", errdefs.ErrUnavailable))
		return
	}
	b.Spec, _ = json.Marshal(spec)
	b.UpdatedAt = s.now().UTC()
	if b, err = s.st.UpdateTemplateBuild(ctx, b); err != nil {
		s.writeError(w, r, err)
		return
	}
	lb := &liveBuild{}
	s.tb.mu.Lock()
	s.tb.live[b.ID] = lb
	s.tb.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.runBuild(caller{TeamID: c.TeamID, KeyID: "template-build"}, b, spec, parent, lb)
	}()
	w.WriteHeader(http.StatusAccepted)
}

// buildSource is where a build starts.
type buildSource struct {
	// From is a platform template or a parent build's snapshot; Key names
	// it for the step cache.
	From, Key string
	// Image is the OCI image under it (nil: the template's own files).
	Image *spacev1.ImageSource
	// Setup runs before the first step when the build starts from From
	// itself.
	Setup string
}

// imageSetup gives an OCI image the sandbox user E2B's templates have
// (uid 1000, home /home/user), with whatever tool the image has.
const imageSetup = `id -u user >/dev/null 2>&1 || useradd -m -u 1000 -s /bin/bash user 2>/dev/null || adduser -D -u 1000 -s /bin/sh user 2>/dev/null || { echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd && echo 'user:x:1000:' >> /etc/group && mkdir -p /home/user && chown 1000:1000 /home/user; }`

// maxImageRef bounds an image reference.
const maxImageRef = 512

// buildParent resolves where a build starts: an OCI image (on the base
// template's substrate and limits), a platform template, or the default
// build of one of the team's templates (its snapshot, on its image).
func (s *Server) buildParent(ctx context.Context, team, self string, spec e2bapi.TemplateBuildStartV2) (buildSource, error) {
	if spec.FromImage != "" {
		ref := spec.FromImage
		if len(ref) > maxImageRef || strings.ContainsAny(ref, " \t\n\r\x00") {
			return buildSource{}, fmt.Errorf("%w: fromImage %q is not an image reference", errdefs.ErrInvalid, truncate(ref, 64))
		}
		src := &spacev1.ImageSource{Ref: ref}
		if r := spec.FromImageRegistry; r != nil {
			if r.Type != "" && r.Type != "registry" {
				return buildSource{}, fmt.Errorf("%w: fromImageRegistry type %q is not supported (only \"registry\" with username and password)", errdefs.ErrInvalid, truncate(r.Type, 32))
			}
			src.Username, src.Password = r.Username, r.Password
		}
		// The credentials are part of the cache key: a build must not be
		// served a cached pull that its own credentials would be refused.
		sum := sha256.Sum256([]byte(src.Username + "\x00" + src.Password))
		key := "image:" + ref + "@creds:" + hex.EncodeToString(sum[:8])
		return buildSource{From: "base", Key: key, Image: src, Setup: imageSetup}, nil
	}
	ref := spec.FromTemplate
	if ref == "" {
		ref = "base"
	}
	if _, ok := s.cfg.Templates[ref]; ok {
		return buildSource{From: ref, Key: "template:" + ref}, nil
	}
	alias, tag, err := splitTemplateRef(team, ref)
	if err != nil {
		return buildSource{}, err
	}
	tpl, err := s.findTemplate(ctx, team, alias)
	if err != nil {
		return buildSource{}, fmt.Errorf("fromTemplate: %w", err)
	}
	if tpl.ID == self {
		return buildSource{}, fmt.Errorf("%w: a template cannot be built from itself", errdefs.ErrInvalid)
	}
	b, err := s.taggedBuild(ctx, tpl, tag)
	if err != nil {
		return buildSource{}, fmt.Errorf("fromTemplate: %w", err)
	}
	return buildSource{From: b.SnapshotID, Key: "snapshot:" + b.SnapshotID, Image: b.Image}, nil
}

// taggedBuild returns the ready build tpl's tag points at.
func (s *Server) taggedBuild(ctx context.Context, tpl store.TemplateRecord, tag string) (store.TemplateBuildRecord, error) {
	t, ok := tpl.Tags[tag]
	if !ok {
		return store.TemplateBuildRecord{}, fmt.Errorf("%w: template %s has no ready build tagged %q", errdefs.ErrNotFound, tpl.Names, tag)
	}
	b, err := s.st.GetTemplateBuild(ctx, tpl.ID, t.BuildID)
	if err != nil {
		return b, err
	}
	if b.Status != e2bapi.BuildReady || b.SnapshotID == "" {
		return b, fmt.Errorf("%w: build %s is %s", errdefs.ErrConflict, b.ID, b.Status)
	}
	return b, nil
}
