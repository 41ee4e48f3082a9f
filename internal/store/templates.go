package store

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

const (
	templatesPrefix     = prefix + "templates/"
	templateBuildPrefix = prefix + "template-builds/"
	buildCachePrefix    = prefix + "template-cache/"
)

// templateIDRE is the form of template and build ids.
var templateIDRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,63}$`)

// ValidTemplateID reports whether id has the form of a template or build id.
func ValidTemplateID(id string) bool { return templateIDRE.MatchString(id) }

// TemplateRecord is a team's built template (E2B's Template.build): its
// names and which build each tag points at. A template's files are the
// snapshot of its build (BuildRecord.SnapshotID).
type TemplateRecord struct {
	ID     string `json:"id"`
	TeamID string `json:"team_id"`
	// Names are the template's aliases, unique per team.
	Names []string `json:"names"`
	// Tags maps a tag ("default" always once a build is ready) to a build.
	Tags       map[string]TemplateTag `json:"tags,omitempty"`
	CPUCount   int                    `json:"cpu_count,omitempty"`
	MemoryMB   int                    `json:"memory_mb,omitempty"`
	DiskSizeMB int                    `json:"disk_size_mb,omitempty"`
	CreatedAt  time.Time              `json:"created_at"`
	UpdatedAt  time.Time              `json:"updated_at"`
	// Revision is etcd's mod revision when read (for UpdateTemplate).
	Revision int64 `json:"-"`
}

// TemplateTag is where a tag points.
type TemplateTag struct {
	BuildID   string    `json:"build_id"`
	CreatedAt time.Time `json:"created_at"`
}

// TemplateBuildRecord is one build of a template.
type TemplateBuildRecord struct {
	ID         string `json:"id"`
	TemplateID string `json:"template_id"`
	TeamID     string `json:"team_id"`
	// Status is e2bapi's waiting, building, ready or error.
	Status string `json:"status"`
	// Tags the build gets when it is ready.
	Tags []string `json:"tags,omitempty"`
	// Spec is the build's instructions (e2bapi.TemplateBuildStartV2) once
	// started.
	Spec json.RawMessage `json:"spec,omitempty"`
	// SnapshotID holds the built files (a ready build).
	SnapshotID string `json:"snapshot_id,omitempty"`
	// BaseTemplate is the platform template the snapshot's files go on.
	BaseTemplate string `json:"base_template,omitempty"`
	// Image is the OCI image under the snapshot's files (a build
	// fromImage, or built on one); nil: the base template's own.
	Image *spacev1.ImageSource `json:"image,omitempty"`
	// Env, Workdir, User, StartCmd and ReadyCmd are what sandboxes of the
	// build start with.
	Env      map[string]string `json:"env,omitempty"`
	Workdir  string            `json:"workdir,omitempty"`
	User     string            `json:"user,omitempty"`
	StartCmd string            `json:"start_cmd,omitempty"`
	ReadyCmd string            `json:"ready_cmd,omitempty"`
	// Logs are the build's log lines (bounded), Reason why it failed and
	// at which step.
	Logs          []BuildLog `json:"logs,omitempty"`
	ReasonMessage string     `json:"reason_message,omitempty"`
	ReasonStep    string     `json:"reason_step,omitempty"`
	CreatedAt     time.Time  `json:"created_at"`
	UpdatedAt     time.Time  `json:"updated_at"`
	FinishedAt    *time.Time `json:"finished_at,omitempty"`
	// Revision is etcd's mod revision when read.
	Revision int64 `json:"-"`
}

// BuildLog is one line of a build's log.
type BuildLog struct {
	Time    time.Time `json:"t"`
	Level   string    `json:"l"`
	Message string    `json:"m"`
	Step    string    `json:"s,omitempty"`
}

func (s *Store) putIfAbsent(ctx context.Context, what, k string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("store: encode %s: %w", what, err)
	}
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).Then(clientv3.OpPut(k, string(data))).Commit()
	if err != nil {
		return wrapErr("create "+what, err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: create %s: %w: already exists", what, errdefs.ErrConflict)
	}
	return nil
}

// putAt writes v at k if k's mod revision is still rev.
func (s *Store) putAt(ctx context.Context, what, k string, rev int64, v any) (int64, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return 0, fmt.Errorf("store: encode %s: %w", what, err)
	}
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", rev)).Then(clientv3.OpPut(k, string(data))).Commit()
	if err != nil {
		return 0, wrapErr("update "+what, err)
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("store: update %s: %w: changed concurrently", what, errdefs.ErrConflict)
	}
	return resp.Header.Revision, nil
}

func (s *Store) getJSON(ctx context.Context, what, k string, v any) (int64, error) {
	resp, err := s.cli.Get(ctx, k)
	if err != nil {
		return 0, wrapErr("get "+what, err)
	}
	if len(resp.Kvs) == 0 {
		return 0, fmt.Errorf("store: %s: %w", what, errdefs.ErrNotFound)
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, v); err != nil {
		return 0, fmt.Errorf("store: decode %s: %w", what, err)
	}
	return resp.Kvs[0].ModRevision, nil
}

// CreateTemplate writes a new template record.
func (s *Store) CreateTemplate(ctx context.Context, rec TemplateRecord) error {
	if !ValidTemplateID(rec.ID) || rec.TeamID == "" {
		return fmt.Errorf("store: create template: %w: bad id or team", errdefs.ErrInvalid)
	}
	return s.putIfAbsent(ctx, "template "+rec.ID, templatesPrefix+rec.ID, rec)
}

// GetTemplate returns a template record or errdefs.ErrNotFound.
func (s *Store) GetTemplate(ctx context.Context, id string) (TemplateRecord, error) {
	var rec TemplateRecord
	if !ValidTemplateID(id) {
		return rec, fmt.Errorf("store: template %q: %w", id, errdefs.ErrNotFound)
	}
	rev, err := s.getJSON(ctx, "template "+id, templatesPrefix+id, &rec)
	rec.Revision = rev
	return rec, err
}

// UpdateTemplate writes rec if it did not change since it was read.
func (s *Store) UpdateTemplate(ctx context.Context, rec TemplateRecord) (TemplateRecord, error) {
	rev, err := s.putAt(ctx, "template "+rec.ID, templatesPrefix+rec.ID, rec.Revision, rec)
	rec.Revision = rev
	return rec, err
}

// ListTemplates returns every template record sorted by id.
func (s *Store) ListTemplates(ctx context.Context) ([]TemplateRecord, error) {
	resp, err := s.cli.Get(ctx, templatesPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list templates", err)
	}
	out := make([]TemplateRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec TemplateRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			s.log.Warn("skipping undecodable template record", "key", string(kv.Key), "err", err)
			continue
		}
		rec.Revision = kv.ModRevision
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// DeleteTemplate removes a template record and its builds' records.
func (s *Store) DeleteTemplate(ctx context.Context, id string) error {
	if !ValidTemplateID(id) {
		return fmt.Errorf("store: template %q: %w", id, errdefs.ErrNotFound)
	}
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpDelete(templatesPrefix+id),
		clientv3.OpDelete(templateBuildPrefix+id+"/", clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return wrapErr("delete template", err)
	}
	if resp.Responses[0].GetResponseDeleteRange().Deleted == 0 {
		return fmt.Errorf("store: template %s: %w", id, errdefs.ErrNotFound)
	}
	return nil
}

// CreateTemplateBuild writes a new build record.
func (s *Store) CreateTemplateBuild(ctx context.Context, rec TemplateBuildRecord) error {
	if !ValidTemplateID(rec.ID) || !ValidTemplateID(rec.TemplateID) {
		return fmt.Errorf("store: create build: %w: bad id", errdefs.ErrInvalid)
	}
	return s.putIfAbsent(ctx, "build "+rec.ID, templateBuildPrefix+rec.TemplateID+"/"+rec.ID, rec)
}

// GetTemplateBuild returns a build record or errdefs.ErrNotFound.
func (s *Store) GetTemplateBuild(ctx context.Context, templateID, id string) (TemplateBuildRecord, error) {
	var rec TemplateBuildRecord
	if !ValidTemplateID(templateID) || !ValidTemplateID(id) {
		return rec, fmt.Errorf("store: build %q: %w", id, errdefs.ErrNotFound)
	}
	rev, err := s.getJSON(ctx, "build "+id, templateBuildPrefix+templateID+"/"+id, &rec)
	rec.Revision = rev
	return rec, err
}

// UpdateTemplateBuild writes rec if it did not change since it was read.
func (s *Store) UpdateTemplateBuild(ctx context.Context, rec TemplateBuildRecord) (TemplateBuildRecord, error) {
	rev, err := s.putAt(ctx, "build "+rec.ID, templateBuildPrefix+rec.TemplateID+"/"+rec.ID, rec.Revision, rec)
	rec.Revision = rev
	return rec, err
}

// ListTemplateBuilds returns a template's builds, oldest first.
func (s *Store) ListTemplateBuilds(ctx context.Context, templateID string) ([]TemplateBuildRecord, error) {
	resp, err := s.cli.Get(ctx, templateBuildPrefix+templateID+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list builds", err)
	}
	out := make([]TemplateBuildRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec TemplateBuildRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			continue
		}
		rec.Revision = kv.ModRevision
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// BuildCacheEntry is a cached build step: the snapshot holding the files
// after every step up to the one whose chained hash keys it.
type BuildCacheEntry struct {
	SnapshotID string            `json:"snapshot_id"`
	Env        map[string]string `json:"env,omitempty"`
	Workdir    string            `json:"workdir,omitempty"`
	User       string            `json:"user,omitempty"`
	CreatedAt  time.Time         `json:"created_at"`
}

var hexKeyRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// GetBuildCache returns team's cache entry for key (a hex sha256).
func (s *Store) GetBuildCache(ctx context.Context, team, key string) (BuildCacheEntry, error) {
	var e BuildCacheEntry
	if !hexKeyRE.MatchString(key) {
		return e, fmt.Errorf("store: build cache: %w", errdefs.ErrNotFound)
	}
	_, err := s.getJSON(ctx, "build cache entry", buildCachePrefix+team+"/"+key, &e)
	return e, err
}

// PutBuildCache records team's cache entry for key.
func (s *Store) PutBuildCache(ctx context.Context, team, key string, e BuildCacheEntry) error {
	if !hexKeyRE.MatchString(key) {
		return fmt.Errorf("store: build cache: %w: bad key", errdefs.ErrInvalid)
	}
	data, err := json.Marshal(e)
	if err != nil {
		return err
	}
	_, err = s.cli.Put(ctx, buildCachePrefix+team+"/"+key, string(data))
	return wrapErr("put build cache", err)
}
