package cli

// Errors are said once, in one line, with the next step: the SDK's error
// classes become a sentence about the object the command named, never
// the class words the layers below stacked up ("not found: not found:").

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/spacesbx/space/sdk"
)

// classWords are the error-class prefixes the server and the SDK put in
// front of messages (errdefs and sdk class names); they are dropped from
// what the user reads, since the sentence says the class itself.
var classWords = []string{
	"not found", "conflict", "invalid argument", "bad request", "unauthorized", "forbidden",
	"unavailable", "timeout", "too large", "rate limited", "server error", "internal",
	"route refresh required", "upstream", "failed precondition", "permission denied",
}

// stripClasses removes leading class words ("not found: not found: x" is
// "x").
func stripClasses(msg string) string {
	for {
		trimmed := false
		for _, w := range classWords {
			if rest, ok := strings.CutPrefix(msg, w+": "); ok {
				msg, trimmed = rest, true
			}
		}
		if !trimmed {
			return msg
		}
	}
}

// sandboxError is an error about one sandbox: describe words it with the
// sandbox's id and the next step.
type sandboxError struct {
	id  string
	err error
}

func (e *sandboxError) Error() string { return "sandbox " + e.id + ": " + e.err.Error() }
func (e *sandboxError) Unwrap() error { return e.err }

// onSandbox marks err (if any) as being about sandbox id.
func onSandbox(id string, err error) error {
	if err == nil {
		return nil
	}
	var se *sandboxError
	if errors.As(err, &se) {
		return err
	}
	return &sandboxError{id: id, err: err}
}

// isPaused says err is a refusal because the sandbox is paused (the
// edge's and the control plane's reason "paused", or a conflict that says
// so).
func isPaused(err error) bool {
	var e *sdk.Error
	if !errors.As(err, &e) {
		return false
	}
	return e.Reason == sdk.ReasonPaused || (errors.Is(err, sdk.ErrConflict) && strings.Contains(e.Message, "is paused"))
}

// hintError adds a next step to an error describe words by class.
type hintError struct {
	err  error
	hint string
}

func (e *hintError) Error() string { return e.err.Error() + " (" + e.hint + ")" }
func (e *hintError) Unwrap() error { return e.err }

func isNotFound(err error) bool { return errors.Is(err, sdk.ErrNotFound) }

// describe renders err as one line (without the "space: " prefix).
func describe(err error, g *globals) string {
	var he *hintError
	if errors.As(err, &he) {
		return describe(he.err, g) + " (" + he.hint + ")"
	}
	var se *sandboxError
	id := ""
	if errors.As(err, &se) {
		id = se.id
	}
	var pe *sdk.ProcessError
	switch {
	case errors.Is(err, context.Canceled):
		return "interrupted"
	case errors.Is(err, sdk.ErrNoLogsAPI):
		return "this server has no sandbox logs API (it predates GET /v2/sandboxes/{id}/logs)"
	case errors.As(err, &pe):
		return pe.Error()
	case id != "" && isPaused(err):
		return fmt.Sprintf("sandbox %s is paused (resume it with: space sandbox resume %s)", id, id)
	case id != "" && errors.Is(err, sdk.ErrNotFound):
		return fmt.Sprintf("sandbox %s not found (list sandboxes with: space sandbox list)", id)
	case errors.Is(err, sdk.ErrUnauthorized) && g != nil && g.apiKey == "" && g.accessToken != "":
		return "the access token was refused (check --access-token or SPACE_ACCESS_TOKEN)"
	case errors.Is(err, sdk.ErrUnauthorized):
		return "the API key was refused (check --api-key or SPACE_API_KEY)"
	case errors.Is(err, sdk.ErrForbidden):
		return "permission denied: " + serverMessage(err) + " (the API key's team or role may not do this)"
	}
	var sdkErr *sdk.Error
	if errors.Is(err, sdk.ErrUnavailable) && !errors.As(err, &sdkErr) {
		// No answer at all: the transport failed.
		url := "the platform"
		if g != nil && g.apiURL != "" {
			url = g.apiURL
		}
		return fmt.Sprintf("cannot reach %s: %s (is `space up` running? set --api-url or SPACE_API_URL)", url, transportCause(err))
	}
	msg := serverMessage(err)
	if id != "" && !strings.Contains(msg, id) {
		msg = "sandbox " + id + ": " + msg
	}
	switch {
	case errors.Is(err, sdk.ErrConflict) && id != "":
		return msg + " (see its state with: space sandbox get " + id + ")"
	case errors.Is(err, sdk.ErrRateLimited):
		return msg + " (rate limited: retry later)"
	case errors.Is(err, sdk.ErrTimeout):
		return msg + " (timed out: retry)"
	}
	return msg
}

// serverMessage is the message of err without the class words in front
// and without the sandbox wrapper.
func serverMessage(err error) string {
	var se *sandboxError
	if errors.As(err, &se) {
		err = se.err
	}
	var e *sdk.Error
	if errors.As(err, &e) {
		if e.Message != "" {
			return stripClasses(e.Message)
		}
		return stripClasses(err.Error())
	}
	return stripClasses(err.Error())
}

// transportCause shortens a transport error to its cause ("connection
// refused").
func transportCause(err error) string {
	msg := stripClasses(err.Error())
	if i := strings.LastIndex(msg, ": "); i >= 0 {
		return msg[i+2:]
	}
	return msg
}

// onFile marks err from a file operation on path in sandbox id: not found
// is the file's, unless the edge said the sandbox is gone.
func onFile(id, path string, err error) error {
	if err == nil {
		return nil
	}
	var e *sdk.Error
	if errors.Is(err, sdk.ErrNotFound) && (!errors.As(err, &e) || e.Reason != sdk.ReasonSandboxNotFound) {
		return fmt.Errorf("%s: no such file or directory in sandbox %s", path, id)
	}
	return onSandbox(id, err)
}
