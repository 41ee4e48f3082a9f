package edge

// What the edge reads inside the Connect envelopes of process streams
// (internal/envelope frames and parses them): the codec, StartEvent pids,
// the pid a Connect request selects, and the end-of-stream errors that
// decide a reattach.

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"mime"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/envelope"
)

const (
	// maxInspect bounds a message the edge decodes (a StartEvent, an
	// end-of-stream message, a Connect request). Larger ones are forwarded
	// without being looked at.
	maxInspect = 64 << 10
)

// codec is the Connect codec of a stream.
type codec int

const (
	codecNone codec = iota
	codecJSON
	codecProto
)

// codecOf returns the codec of a Connect streaming Content-Type.
func codecOf(contentType string) codec {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return codecNone
	}
	switch mt {
	case "application/connect+json":
		return codecJSON
	case "application/connect+proto":
		return codecProto
	}
	return codecNone
}

func (c codec) contentType() string {
	if c == codecProto {
		return "application/connect+proto"
	}
	return "application/connect+json"
}

func (c codec) unmarshal(b []byte, m proto.Message) error {
	if c == codecProto {
		return proto.Unmarshal(b, m)
	}
	return protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, m)
}

func (c codec) marshal(m proto.Message) ([]byte, error) {
	if c == codecProto {
		return proto.Marshal(m)
	}
	return protojson.Marshal(m)
}

// payloadOf returns a message's uncompressed payload. Only gzip (the one
// encoding connect-go servers offer by default) is decoded; ok is false for
// payloads the edge cannot read.
func payloadOf(flags byte, payload []byte, encoding string) ([]byte, bool) {
	if flags&envelope.FlagCompressed == 0 {
		return payload, true
	}
	if encoding != "gzip" {
		return nil, false
	}
	zr, err := gzip.NewReader(bytes.NewReader(payload))
	if err != nil {
		return nil, false
	}
	defer zr.Close()
	out, err := io.ReadAll(io.LimitReader(zr, maxInspect+1))
	if err != nil || len(out) > maxInspect {
		return nil, false
	}
	return out, true
}

// startPid returns the pid of a StartResponse/ConnectResponse message that
// carries a StartEvent (both responses have the same shape).
func startPid(c codec, payload []byte) (uint32, bool) {
	var m processpb.ConnectResponse
	if c.unmarshal(payload, &m) != nil {
		return 0, false
	}
	st := m.GetEvent().GetStart()
	if st == nil {
		return 0, false
	}
	return st.GetPid(), true
}

// selectedPid returns the pid a Connect request body (one envelope)
// selects; ok is false for a tag selector or an unreadable body.
func selectedPid(c codec, body []byte, encoding string) (uint32, bool) {
	h, payload, err := envelope.Single(body, maxInspect)
	if err != nil {
		return 0, false
	}
	payload, ok := payloadOf(h.Flags, payload, encoding)
	if !ok {
		return 0, false
	}
	var m processpb.ConnectRequest
	if c.unmarshal(payload, &m) != nil {
		return 0, false
	}
	sel, ok := m.GetProcess().GetSelector().(*processpb.ProcessSelector_Pid)
	if !ok {
		return 0, false
	}
	return sel.Pid, true
}

// connectRequestBody is the body of a Connect call that selects pid.
func connectRequestBody(c codec, pid uint32) ([]byte, error) {
	b, err := c.marshal(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{
		Selector: &processpb.ProcessSelector_Pid{Pid: pid}}})
	if err != nil {
		return nil, fmt.Errorf("encoding connect request: %w", err)
	}
	return envelope.Frame(0, b), nil
}

// executionReplaced reports whether the stream ended because its execution
// was replaced (sbx-manager's leaseWriter, spacev1.ReasonExecutionReplaced).
func executionReplaced(e envelope.EndError) bool {
	return e.Code != "" && strings.HasPrefix(e.Message, spacev1.ReasonExecutionReplaced)
}

// processNotFound reports a Connect not_found: the process does not exist
// there.
func processNotFound(e envelope.EndError) bool { return e.Code == "not_found" }
