package controlplane

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// decodeJSON reads one JSON value of at most MaxBodyBytes from r's body into
// v. strict rejects unknown fields. Every failure is errdefs.ErrInvalid (or
// errdefs.ErrTooLarge) with a message naming the problem.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any, strict bool) error {
	body := http.MaxBytesReader(w, r.Body, MaxBodyBytes)
	defer body.Close()
	return decodeReader(body, v, strict)
}

func decodeReader(rd io.Reader, v any, strict bool) error {
	dec := json.NewDecoder(rd)
	if strict {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return classifyDecodeError(err)
	}
	// Only whitespace may follow.
	var extra json.RawMessage
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return fmt.Errorf("request body %w: body exceeds %d bytes", errdefs.ErrTooLarge, mbe.Limit)
		}
		return fmt.Errorf("%w: unexpected data after the JSON body", errdefs.ErrInvalid)
	}
	return nil
}

func classifyDecodeError(err error) error {
	var (
		mbe *http.MaxBytesError
		se  *json.SyntaxError
		te  *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &mbe):
		return fmt.Errorf("request body %w: body exceeds %d bytes", errdefs.ErrTooLarge, mbe.Limit)
	case errors.Is(err, io.EOF):
		return fmt.Errorf("%w: empty body, expected a JSON object", errdefs.ErrInvalid)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("%w: truncated JSON body", errdefs.ErrInvalid)
	case errors.As(err, &se):
		return fmt.Errorf("%w: malformed JSON at byte %d", errdefs.ErrInvalid, se.Offset)
	case errors.As(err, &te):
		if te.Field != "" {
			return fmt.Errorf("%w: field %q must be %s", errdefs.ErrInvalid, te.Field, jsonKind(te.Type.String()))
		}
		return fmt.Errorf("%w: body must be a JSON object", errdefs.ErrInvalid)
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return fmt.Errorf("%w: %s", errdefs.ErrInvalid, strings.TrimPrefix(err.Error(), "json: "))
	}
	return fmt.Errorf("%w: undecodable JSON body", errdefs.ErrInvalid)
}

func jsonKind(goType string) string {
	switch {
	case strings.Contains(goType, "int"):
		return "an integer in range"
	case strings.Contains(goType, "bool"):
		return "a boolean"
	case strings.Contains(goType, "string") && strings.HasPrefix(goType, "map"):
		return "an object of strings"
	case goType == "string":
		return "a string"
	case strings.HasPrefix(goType, "[]"):
		return "an array"
	}
	return "of type " + goType
}

// parseSandboxID validates a sandbox id from a path.
func parseSandboxID(raw string) (string, error) {
	if err := identity.ValidateSandboxID(raw); err != nil {
		return "", fmt.Errorf("%w: sandbox id must be 1..63 lowercase letters, digits or inner hyphens", errdefs.ErrInvalid)
	}
	return raw, nil
}

// decodeOptionalJSON decodes a body that may be absent or empty.
func decodeOptionalJSON(w http.ResponseWriter, r *http.Request, v any) error {
	body := http.MaxBytesReader(w, r.Body, MaxBodyBytes)
	defer body.Close()
	data, err := io.ReadAll(body)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return fmt.Errorf("request body %w: body exceeds %d bytes", errdefs.ErrTooLarge, mbe.Limit)
		}
		return fmt.Errorf("%w: reading body: %v", errdefs.ErrInvalid, err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil
	}
	return decodeReader(bytes.NewReader(data), v, false)
}

// ttl validates a timeout in seconds (nil: def).
func (s *Server) ttl(secs *int32, def time.Duration) (time.Duration, error) {
	if secs == nil {
		return def, nil
	}
	d := time.Duration(*secs) * time.Second
	if *secs <= 0 || d > s.cfg.MaxTimeout {
		return 0, fmt.Errorf("%w: timeout must be 1..%d seconds", errdefs.ErrInvalid, int64(s.cfg.MaxTimeout/time.Second))
	}
	return d, nil
}
