package e2bapi

import "time"

// Template build statuses (TemplateBuildStatus).
const (
	BuildWaiting  = "waiting"
	BuildBuilding = "building"
	BuildReady    = "ready"
	BuildError    = "error"
)

// TemplateBuildRequestV3 is the body of POST /v3/templates
// (Template.build's requestBuild).
type TemplateBuildRequestV3 struct {
	Name          string   `json:"name"`
	Tags          []string `json:"tags,omitempty"`
	CPUCount      *int     `json:"cpuCount,omitempty"`
	MemoryMB      *int     `json:"memoryMB,omitempty"`
	MinFreeDiskMB *int     `json:"minFreeDiskMb,omitempty"`
}

// TemplateRequestResponseV3 answers POST /v3/templates.
type TemplateRequestResponseV3 struct {
	TemplateID string   `json:"templateID"`
	BuildID    string   `json:"buildID"`
	Public     bool     `json:"public"`
	Aliases    []string `json:"aliases"`
	Names      []string `json:"names"`
	Tags       []string `json:"tags"`
}

// TemplateBuildFileUpload answers GET /templates/{id}/files/{hash}: URL is
// where the SDK PUTs the files' tar when Present is false.
type TemplateBuildFileUpload struct {
	Present bool    `json:"present"`
	URL     *string `json:"url,omitempty"`
}

// TemplateBuildStartV2 is the body of POST /v2/templates/{id}/builds/{buildID}
// (the SDK's TemplateBase.serialize).
type TemplateBuildStartV2 struct {
	FromTemplate      string             `json:"fromTemplate,omitempty"`
	FromImage         string             `json:"fromImage,omitempty"`
	FromImageRegistry *FromImageRegistry `json:"fromImageRegistry,omitempty"`
	Steps             []TemplateStep     `json:"steps"`
	StartCmd          string             `json:"startCmd,omitempty"`
	ReadyCmd          string             `json:"readyCmd,omitempty"`
	Force             bool               `json:"force,omitempty"`
}

// FromImageRegistry carries a registry's credentials (type "registry":
// username and password; the cloud providers' types are not supported).
type FromImageRegistry struct {
	Type     string `json:"type"`
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// TemplateStep is one build instruction: RUN [cmd, user?], COPY [src, dest,
// user, mode] with FilesHash, ENV [k, v, k, v...], WORKDIR [dir], USER [name].
type TemplateStep struct {
	Type      string   `json:"type"`
	Args      []string `json:"args,omitempty"`
	Force     bool     `json:"force,omitempty"`
	FilesHash string   `json:"filesHash,omitempty"`
}

// BuildLogEntry is one line of a build's log.
type BuildLogEntry struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
	Step      string    `json:"step,omitempty"`
}

// BuildStatusReason says why a build failed: Step is the failing step's
// index (as a string, "base" or "finalize" for the ends).
type BuildStatusReason struct {
	Message    string          `json:"message"`
	Step       string          `json:"step,omitempty"`
	LogEntries []BuildLogEntry `json:"logEntries,omitempty"`
}

// TemplateBuildInfo answers GET /templates/{id}/builds/{buildID}/status.
type TemplateBuildInfo struct {
	TemplateID string             `json:"templateID"`
	BuildID    string             `json:"buildID"`
	Status     string             `json:"status"`
	Logs       []string           `json:"logs"`
	LogEntries []BuildLogEntry    `json:"logEntries"`
	Reason     *BuildStatusReason `json:"reason,omitempty"`
}

// TemplateAliasResponse answers GET /templates/aliases/{alias}.
type TemplateAliasResponse struct {
	TemplateID string `json:"templateID"`
	Public     bool   `json:"public"`
}

// Template is one entry of GET /templates.
type Template struct {
	TemplateID    string     `json:"templateID"`
	BuildID       string     `json:"buildID"`
	CPUCount      int        `json:"cpuCount"`
	MemoryMB      int        `json:"memoryMB"`
	DiskSizeMB    int        `json:"diskSizeMB"`
	Public        bool       `json:"public"`
	Aliases       []string   `json:"aliases"`
	Names         []string   `json:"names"`
	CreatedAt     time.Time  `json:"createdAt"`
	UpdatedAt     time.Time  `json:"updatedAt"`
	SpawnCount    int64      `json:"spawnCount"`
	BuildCount    int        `json:"buildCount"`
	BuildStatus   string     `json:"buildStatus"`
	EnvdVersion   string     `json:"envdVersion"`
	LastSpawnedAt *time.Time `json:"lastSpawnedAt,omitempty"`
}

// TemplateBuild is one build of GET /templates/{id}.
type TemplateBuild struct {
	BuildID    string     `json:"buildID"`
	Status     string     `json:"status"`
	CreatedAt  time.Time  `json:"createdAt"`
	UpdatedAt  time.Time  `json:"updatedAt"`
	FinishedAt *time.Time `json:"finishedAt,omitempty"`
	CPUCount   int        `json:"cpuCount"`
	MemoryMB   int        `json:"memoryMB"`
}

// TemplateWithBuilds answers GET /templates/{id}.
type TemplateWithBuilds struct {
	TemplateID string          `json:"templateID"`
	Public     bool            `json:"public"`
	Aliases    []string        `json:"aliases"`
	Names      []string        `json:"names"`
	CreatedAt  time.Time       `json:"createdAt"`
	UpdatedAt  time.Time       `json:"updatedAt"`
	SpawnCount int64           `json:"spawnCount"`
	Builds     []TemplateBuild `json:"builds"`
}

// AssignTemplateTagsRequest is POST /templates/tags: Target is
// "name:tag" (the build the tags get), Tags the new tags.
type AssignTemplateTagsRequest struct {
	Target string   `json:"target"`
	Tags   []string `json:"tags"`
}

// AssignedTemplateTags answers POST /templates/tags.
type AssignedTemplateTags struct {
	BuildID string   `json:"buildID"`
	Tags    []string `json:"tags"`
}

// DeleteTemplateTagsRequest is DELETE /templates/tags.
type DeleteTemplateTagsRequest struct {
	Name string   `json:"name"`
	Tags []string `json:"tags"`
}

// TemplateTag is one entry of GET /templates/{id}/tags.
type TemplateTag struct {
	Tag       string    `json:"tag"`
	BuildID   string    `json:"buildID"`
	CreatedAt time.Time `json:"createdAt"`
}
