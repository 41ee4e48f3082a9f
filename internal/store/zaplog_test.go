package store

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"
)

// etcd's warnings reach slog with component=etcd; info is dropped; the
// listener-closed errors are dropped only once the store is closing.
func TestEtcdLogsGoToSlog(t *testing.T) {
	var buf bytes.Buffer
	var closing atomic.Bool
	zl := newEtcdLogger(slog.New(slog.NewTextHandler(&buf, nil)), &closing).With(zap.String("member", "space"))
	zl.Info("chatty")
	zl.Warn("apply request took too long", zap.Duration("took", 0))
	closed := errors.New("accept tcp 127.0.0.1:1: use of closed network connection")
	zl.Error("serving failed", zap.Error(closed))
	closing.Store(true)
	zl.Error("serving failed late", zap.Error(closed))
	zl.Error("disk full", zap.Error(errors.New("no space left on device")))
	out := buf.String()
	for _, want := range []string{"component=etcd", "apply request took too long", "member=space", `msg="serving failed"`, "disk full"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	for _, not := range []string{"chatty", "serving failed late"} {
		if strings.Contains(out, not) {
			t.Errorf("log has %q:\n%s", not, out)
		}
	}
}
