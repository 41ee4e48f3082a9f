package sdk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
)

// Template builds, as E2B's Template.build drives them: RequestBuild makes
// a waiting build, UploadFiles sends a COPY step's archive (once per
// hash), StartBuild runs the steps, BuildStatus reports progress and logs.

// BuildStep is one instruction of a template build.
type BuildStep = e2bapi.TemplateStep

// BuildSpec is what a build runs.
type BuildSpec = e2bapi.TemplateBuildStartV2

// BuildStatus is a build's state and its log lines from an offset.
type BuildStatus = e2bapi.TemplateBuildInfo

// BuildRef names a requested build.
type BuildRef struct {
	TemplateID, BuildID string
	Tags                []string
}

// RequestBuild asks for a build of template name ("alias" or
// "alias:tag"), creating the template on its first build.
func (c *Client) RequestBuild(ctx context.Context, name string, tags []string) (BuildRef, error) {
	var out e2bapi.TemplateRequestResponseV3
	if err := c.rest(ctx, http.MethodPost, "/v3/templates", e2bapi.TemplateBuildRequestV3{Name: name, Tags: tags}, &out, nil); err != nil {
		return BuildRef{}, err
	}
	return BuildRef{TemplateID: out.TemplateID, BuildID: out.BuildID, Tags: out.Tags}, nil
}

// UploadFiles sends the archive of a COPY step (a tar, as the build
// unpacks it: paths relative to the build context) under hash, unless the
// platform has it already. It reports whether it uploaded.
func (c *Client) UploadFiles(ctx context.Context, ref BuildRef, hash string, archive io.Reader, size int64) (bool, error) {
	var link e2bapi.TemplateBuildFileUpload
	path := "/templates/" + url.PathEscape(ref.TemplateID) + "/files/" + url.PathEscape(hash)
	if err := c.rest(ctx, http.MethodGet, path, nil, &link, nil); err != nil {
		return false, err
	}
	if link.Present || link.URL == nil {
		return false, nil
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, *link.URL, archive)
	if err != nil {
		return false, err
	}
	req.ContentLength = size
	res, err := c.http.Do(req)
	if err != nil {
		return false, fmt.Errorf("%w: upload: %v", ErrUnavailable, err)
	}
	defer res.Body.Close()
	if res.StatusCode < 200 || res.StatusCode > 299 {
		return false, errorFromResponse(res)
	}
	return true, nil
}

// StartBuild runs a requested build.
func (c *Client) StartBuild(ctx context.Context, ref BuildRef, spec BuildSpec) error {
	path := "/v2/templates/" + url.PathEscape(ref.TemplateID) + "/builds/" + url.PathEscape(ref.BuildID)
	return c.rest(ctx, http.MethodPost, path, spec, nil, nil)
}

// GetBuildStatus returns a build's status and its log lines from
// logsOffset on.
func (c *Client) GetBuildStatus(ctx context.Context, ref BuildRef, logsOffset int) (*BuildStatus, error) {
	var out BuildStatus
	path := "/templates/" + url.PathEscape(ref.TemplateID) + "/builds/" + url.PathEscape(ref.BuildID) + "/status?logsOffset=" + strconv.Itoa(logsOffset)
	if err := c.rest(ctx, http.MethodGet, path, nil, &out, nil); err != nil {
		return nil, err
	}
	return &out, nil
}

// WaitBuild polls a build until it ends, passing each log line to onLog
// (nil: dropped). A failed build returns a *BuildError.
func (c *Client) WaitBuild(ctx context.Context, ref BuildRef, onLog func(BuildLogEntry)) error {
	offset := 0
	for {
		st, err := c.GetBuildStatus(ctx, ref, offset)
		if err != nil {
			return err
		}
		offset += len(st.LogEntries)
		for _, l := range st.LogEntries {
			if onLog != nil {
				onLog(l)
			}
		}
		switch st.Status {
		case e2bapi.BuildReady:
			if len(st.LogEntries) == 0 {
				return nil
			}
			continue // drain the tail first
		case e2bapi.BuildError:
			if len(st.LogEntries) > 0 {
				continue
			}
			be := &BuildError{Message: "build failed"}
			if st.Reason != nil {
				be.Message, be.Step = st.Reason.Message, st.Reason.Step
			}
			return be
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// BuildError is a failed template build.
type BuildError struct {
	// Step is the failing step's number ("1".., "base", "finalize").
	Step    string
	Message string
}

func (e *BuildError) Error() string {
	if e.Step != "" {
		return fmt.Sprintf("build failed at step %s: %s", e.Step, e.Message)
	}
	return "build failed: " + e.Message
}

// TemplateExists reports whether the caller may create sandboxes from
// template name.
func (c *Client) TemplateExists(ctx context.Context, name string) (bool, error) {
	err := c.rest(ctx, http.MethodGet, "/templates/aliases/"+url.PathEscape(name), nil, nil, nil)
	if err == nil {
		return true, nil
	}
	var e *Error
	if errors.As(err, &e) && e.Status == http.StatusNotFound {
		return false, nil
	}
	return false, err
}

// BuildLogEntry is one line of a build's log.
type BuildLogEntry = e2bapi.BuildLogEntry

// FromImageRegistry carries a registry's credentials for BuildSpec.
type FromImageRegistry = e2bapi.FromImageRegistry
