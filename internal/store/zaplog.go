package store

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// etcd logs through zap; the rest of SPACE through log/slog. slogCore hands
// etcd's (embedded server and client) entries at warn and above to the
// store's slog logger with component=etcd, so they land where the
// platform's logs go instead of as JSON on stderr.
//
// While the store is closing, etcd reports its own listeners closing as
// errors ("use of closed network connection", "http: Server closed"):
// those are the shutdown we asked for and are dropped.
type slogCore struct {
	log     *slog.Logger
	closing *atomic.Bool
	fields  []zapcore.Field
}

func newEtcdLogger(log *slog.Logger, closing *atomic.Bool) *zap.Logger {
	return zap.New(&slogCore{log: log.With("component", "etcd"), closing: closing})
}

func (c *slogCore) Enabled(l zapcore.Level) bool { return l >= zapcore.WarnLevel }

func (c *slogCore) With(fields []zapcore.Field) zapcore.Core {
	return &slogCore{log: c.log, closing: c.closing, fields: append(append([]zapcore.Field(nil), c.fields...), fields...)}
}

func (c *slogCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c *slogCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range append(append([]zapcore.Field(nil), c.fields...), fields...) {
		f.AddTo(enc)
	}
	if c.closing.Load() && isShutdownNoise(e.Message, enc.Fields) || isBenign(e, enc.Fields) {
		return nil
	}
	attrs := make([]slog.Attr, 0, len(enc.Fields))
	for k, v := range enc.Fields {
		attrs = append(attrs, slog.Any(k, v))
	}
	level := slog.LevelWarn
	if e.Level >= zapcore.ErrorLevel {
		level = slog.LevelError
	}
	c.log.LogAttrs(context.Background(), level, e.Message, attrs...)
	return nil
}

func (c *slogCore) Sync() error { return nil }

// benignWarnings are warnings embedded etcd prints on every start that say
// nothing about a single-member etcd on loopback: one port for its HTTP and
// gRPC (it is not exposed), and the simple (unsigned) auth token (SPACE
// runs etcd without auth). Only these exact warnings are dropped; errors
// never are.
var benignWarnings = map[string]bool{
	"Running http and grpc server on single port. This is not recommended for production.": true,
	"simple token is not cryptographically signed":                                         true,
}

// isBenign reports a warning that is not a problem: a known start-up
// warning, or the client's note that a call was canceled by its caller.
func isBenign(e zapcore.Entry, fields map[string]any) bool {
	if e.Level != zapcore.WarnLevel {
		return false
	}
	if benignWarnings[e.Message] {
		return true
	}
	err, _ := fields["error"].(string)
	return e.Message == "retrying of unary invoker failed" && strings.Contains(err, "code = Canceled")
}

// isShutdownNoise reports an entry about etcd's own listeners closing.
func isShutdownNoise(msg string, fields map[string]any) bool {
	err, _ := fields["error"].(string)
	for _, s := range []string{"use of closed network connection", "Server closed", "server closed"} {
		if strings.Contains(err, s) || strings.Contains(msg, s) {
			return true
		}
	}
	return false
}
