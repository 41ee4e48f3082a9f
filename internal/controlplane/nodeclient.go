package controlplane

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// maxNodeResponse bounds what is read from a node-api answer.
const maxNodeResponse = 1 << 20

// nodeClient makes every call the control plane makes to a worker's
// node-api. Each call carries a control capability for exactly the route
// it names and has a deadline of its own.
type nodeClient struct {
	http   *http.Client
	signer *rotatingSigner
	now    func() time.Time
	// installTimeout bounds calls that may copy a whole writable layer
	// (install, snapshot); callTimeout bounds the others.
	installTimeout time.Duration
	callTimeout    time.Duration
}

// install asks the worker to persist and activate the execution.
func (n *nodeClient) install(ctx context.Context, nodeURL string, req spacev1.InstallRequest) (spacev1.InstallResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, n.installTimeout)
	defer cancel()
	var resp spacev1.InstallResponse
	if err := n.call(ctx, nodeURL, spacev1.NodePathInstall, req.Route, req, &resp); err != nil {
		return resp, err
	}
	if resp.Route != (identity.Route{}) && resp.Route != req.Route {
		return resp, fmt.Errorf("%w: worker %s installed another identity (%s)", errdefs.ErrUpstream, req.Route.WorkerID,
			strings.Join(identity.Diff(req.Route, resp.Route), ","))
	}
	return resp, nil
}

// teardown asks the worker to stop the execution and delete its record. A
// 404 (nothing installed) counts as done.
func (n *nodeClient) teardown(ctx context.Context, nodeURL string, route identity.Route) error {
	ctx, cancel := context.WithTimeout(ctx, n.callTimeout)
	defer cancel()
	return ignoreNotFound(n.call(ctx, nodeURL, spacev1.NodePathTeardown, route, spacev1.TeardownRequest{Route: route}, nil))
}

// setNetwork replaces the execution's egress policy; the worker answers
// once it is in force.
func (n *nodeClient) setNetwork(ctx context.Context, nodeURL string, req spacev1.NetworkRequest) error {
	ctx, cancel := context.WithTimeout(ctx, n.callTimeout)
	defer cancel()
	return n.call(ctx, nodeURL, spacev1.NodePathNetwork, req.Route, req, nil)
}

// pause freezes the execution (same execution, processes kept).
func (n *nodeClient) pause(ctx context.Context, nodeURL string, route identity.Route) error {
	return n.lifecycle(ctx, nodeURL, spacev1.NodePathPause, route)
}

// resume thaws a paused execution on the same worker.
func (n *nodeClient) resume(ctx context.Context, nodeURL string, route identity.Route) error {
	return n.lifecycle(ctx, nodeURL, spacev1.NodePathResume, route)
}

// retire tells the old worker its execution is retired. A 404 (nothing
// installed any more) counts as done.
func (n *nodeClient) retire(ctx context.Context, nodeURL string, route identity.Route) error {
	return ignoreNotFound(n.lifecycle(ctx, nodeURL, spacev1.NodePathRetire, route))
}

func (n *nodeClient) lifecycle(ctx context.Context, nodeURL, path string, route identity.Route) error {
	ctx, cancel := context.WithTimeout(ctx, n.callTimeout)
	defer cancel()
	return n.call(ctx, nodeURL, path, route, spacev1.LifecycleRequest{Route: route}, nil)
}

// snapshot archives the paused execution's writable layer as snapID.
func (n *nodeClient) snapshot(ctx context.Context, nodeURL string, route identity.Route, snapID string) (spacev1.SnapshotResponse, error) {
	// Archiving a large writable layer takes longer than a control call.
	ctx, cancel := context.WithTimeout(ctx, n.installTimeout)
	defer cancel()
	var resp spacev1.SnapshotResponse
	err := n.call(ctx, nodeURL, spacev1.NodePathSnapshot, route, spacev1.SnapshotRequest{Route: route, SnapshotID: snapID}, &resp)
	if err == nil && resp.SnapshotID != "" && resp.SnapshotID != snapID {
		err = fmt.Errorf("%w: worker %s stored snapshot %q, asked for %q", errdefs.ErrUpstream, route.WorkerID, truncate(resp.SnapshotID, 80), snapID)
	}
	return resp, err
}

// controlToken issues a control capability for route (so its worker claim
// names the target worker).
func (n *nodeClient) controlToken(route identity.Route) (string, error) {
	tok, _, err := n.signer.Issue(capability.Claims{
		Route: route, Purpose: capability.PurposeControl, Caller: "space-api", IssuedAt: n.now(),
	})
	if err != nil {
		return "", fmt.Errorf("issue control capability: %w", err)
	}
	return tok, nil
}

// call POSTs body to nodeURL+path with a control capability for route and
// decodes a 2xx answer into out (if non-nil).
func (n *nodeClient) call(ctx context.Context, nodeURL, path string, route identity.Route, body, out any) error {
	u, err := url.Parse(nodeURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: worker %s has a bad node url", errdefs.ErrUnavailable, route.WorkerID)
	}
	tok, err := n.controlToken(route)
	if err != nil {
		return err
	}
	data, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(nodeURL, "/")+path, bytes.NewReader(data))
	if err != nil {
		return fmt.Errorf("%w: worker %s: %v", errdefs.ErrUnavailable, route.WorkerID, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(spacev1.HeaderCapability, tok)
	resp, err := n.http.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("%w: worker %s did not answer in time", errdefs.ErrUnavailable, route.WorkerID)
		}
		return fmt.Errorf("%w: worker %s unreachable", errdefs.ErrUnavailable, route.WorkerID)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxNodeResponse))
	if err != nil {
		return fmt.Errorf("%w: worker %s: reading answer: %v", errdefs.ErrUpstream, route.WorkerID, err)
	}
	if resp.StatusCode/100 != 2 {
		var e spacev1.Error
		msg := http.StatusText(resp.StatusCode)
		if json.Unmarshal(raw, &e) == nil && e.Message != "" {
			msg = e.Message
		}
		return &nodeError{Status: resp.StatusCode, Worker: route.WorkerID, Message: truncate(msg, 300), Reason: e.Reason}
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return fmt.Errorf("%w: worker %s: undecodable answer: %v", errdefs.ErrUpstream, route.WorkerID, err)
		}
	}
	return nil
}

// nodeError is a non-2xx answer from node-api.
type nodeError struct {
	Status  int
	Worker  string
	Message string
	// Reason is the worker's JSON error reason (spacev1.Reason*), if any.
	Reason string
}

func (e *nodeError) Error() string {
	return fmt.Sprintf("worker %s answered %d: %s", e.Worker, e.Status, e.Message)
}

// Unwrap classes the worker's answer for the control plane's own client:
// a worker that is unavailable makes the operation unavailable (retry
// later); anything else it refused or failed (its 404 for an execution, its
// 409, its 5xx) is an upstream failure, not the client's request being
// wrong.
func (e *nodeError) Unwrap() error {
	if class := errdefs.FromHTTPStatus(e.Status, ""); errors.Is(class, errdefs.ErrUnavailable) {
		return errdefs.ErrUnavailable
	}
	return errdefs.ErrUpstream
}

// executionLost reports a worker's answer that the execution's processes
// are gone while its record (and files) are there: the worker restarted.
func executionLost(err error) bool {
	var ne *nodeError
	return errors.As(err, &ne) && ne.Reason == spacev1.ReasonExecutionLost
}

// definiteRefusal reports whether a node call failed with an answer that
// says nothing was done (a 4xx), as opposed to an unknown outcome.
func definiteRefusal(err error) bool {
	var ne *nodeError
	return errors.As(err, &ne) && ne.Status >= 400 && ne.Status < 500
}

// ignoreNotFound drops a worker's 404: for a teardown or a retirement,
// nothing installed is the outcome asked for.
func ignoreNotFound(err error) error {
	var ne *nodeError
	if errors.As(err, &ne) && ne.Status == http.StatusNotFound {
		return nil
	}
	return err
}
