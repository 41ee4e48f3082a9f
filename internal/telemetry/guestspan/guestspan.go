// Package guestspan is how the guest agent reports its span of a traced
// request without a tracing SDK or any network of its own: the agent (in a
// sandbox with no route to a collector) answers a request that carried a
// sampled W3C traceparent with a response header, Space-Guest-Span, holding
// the time it took to answer (to the response's headers: a whole unary
// call, the opening of a stream, which the client may abandon before any
// trailer could arrive) and the status; spaced-host, which sent the
// traceparent, reads and removes the header and records the guest's span
// under its own span, anchored at its own clock (the guest's clock is not
// trusted). The guest chooses no trace ids, names or attributes: only a
// duration and a status within fixed bounds. Anything else is malformed
// and dropped (fail closed); the format is versioned ("v1").
//
// It links into the static guest, so it imports nothing but the standard
// library.
package guestspan

import (
	"errors"
	"strconv"
	"strings"
	"time"
)

// Header is the response header the guest sets and spaced-host consumes
// (never forwarded past spaced-host).
const Header = "Space-Guest-Span"

// Version is the trailer's format: "v1 dur_us=<n> status=<code>".
const Version = "v1"

// MaxDuration bounds a reported duration (a stream may run for a day).
const MaxDuration = 24 * time.Hour

// ErrMalformed is any value that is not exactly the current format.
var ErrMalformed = errors.New("guestspan: malformed")

// Span is what the guest reports.
type Span struct {
	Duration time.Duration
	Status   int
}

// Format renders s as the trailer's value.
func Format(s Span) string {
	return Version + " dur_us=" + strconv.FormatInt(s.Duration.Microseconds(), 10) + " status=" + strconv.Itoa(s.Status)
}

// Parse reads a trailer value; anything but Format's output within bounds
// is ErrMalformed.
func Parse(v string) (Span, error) {
	if len(v) > 64 {
		return Span{}, ErrMalformed
	}
	f := strings.Split(v, " ")
	if len(f) != 3 || f[0] != Version || !strings.HasPrefix(f[1], "dur_us=") || !strings.HasPrefix(f[2], "status=") {
		return Span{}, ErrMalformed
	}
	us, err := strconv.ParseInt(f[1][len("dur_us="):], 10, 64)
	if err != nil || us < 0 || us > MaxDuration.Microseconds() || strconv.FormatInt(us, 10) != f[1][len("dur_us="):] {
		return Span{}, ErrMalformed
	}
	st, err := strconv.Atoi(f[2][len("status="):])
	if err != nil || st < 100 || st > 599 || strconv.Itoa(st) != f[2][len("status="):] {
		return Span{}, ErrMalformed
	}
	return Span{Duration: time.Duration(us) * time.Microsecond, Status: st}, nil
}

// Sampled reports whether traceparent is a well-formed W3C version-00
// traceparent with the sampled flag and non-zero ids: only then does the
// guest report a span. Any other value (including future versions, which
// the guest does not know) is not traced.
func Sampled(traceparent string) bool {
	// 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>
	if len(traceparent) != 55 || traceparent[:3] != "00-" || traceparent[35] != '-' || traceparent[52] != '-' {
		return false
	}
	tid, sid, flags := traceparent[3:35], traceparent[36:52], traceparent[53:55]
	if !lowerHex(tid) || !lowerHex(sid) || !lowerHex(flags) || allZero(tid) || allZero(sid) {
		return false
	}
	f, _ := strconv.ParseUint(flags, 16, 8)
	return f&1 == 1
}

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

func allZero(s string) bool { return strings.Trim(s, "0") == "" }
