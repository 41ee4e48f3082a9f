// Package logsetup builds the one slog logger a SPACE binary hands to all
// its components, so every binary offers the same format and level
// choice (--log-format, --log-level; the mains take their defaults from
// SPACE_LOG_FORMAT and SPACE_LOG_LEVEL) and no component builds a handler
// of its own. Environment variables are read in cmd/ only: callers pass
// them in as Options.
package logsetup

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"

	"go.opentelemetry.io/otel/trace"

	"github.com/spacesbx/space/internal/errdefs"
)

// Formats a logger writes.
const (
	FormatText = "text" // slog's key=value lines, for people (the default)
	FormatJSON = "json" // one JSON object a line, for log collectors
)

// Environment variables the mains read for the defaults of the flags.
const (
	EnvFormat = "SPACE_LOG_FORMAT"
	EnvLevel  = "SPACE_LOG_LEVEL"
)

// Options choose a logger's format and level. Zero fields are the
// defaults: text, info.
type Options struct {
	// Format is FormatText or FormatJSON. Default FormatText.
	Format string
	// Level is debug, info, warn or error (slog.Level's text). Default info.
	Level string
}

func (o Options) withDefaults() Options {
	if o.Format == "" {
		o.Format = FormatText
	}
	if o.Level == "" {
		o.Level = "info"
	}
	return o
}

// Validate checks o; zero fields are valid (they are the defaults).
func (o Options) Validate() error {
	_, err := o.level()
	if err != nil {
		return err
	}
	switch o.Format {
	case "", FormatText, FormatJSON:
		return nil
	}
	return fmt.Errorf("log format %q: %w: want %s or %s", o.Format, errdefs.ErrInvalid, FormatText, FormatJSON)
}

func (o Options) level() (slog.Level, error) {
	var lv slog.Level
	if o.Level == "" {
		return slog.LevelInfo, nil
	}
	if err := lv.UnmarshalText([]byte(o.Level)); err != nil {
		return 0, fmt.Errorf("log level %q: %w: want debug, info, warn or error", o.Level, errdefs.ErrInvalid)
	}
	return lv, nil
}

// Flags registers --log-format and --log-level on fs, with def (typically
// from EnvFormat and EnvLevel) as their defaults, and returns the Options
// they fill once fs is parsed.
func Flags(fs *flag.FlagSet, def Options) *Options {
	def = def.withDefaults()
	o := &Options{}
	fs.StringVar(&o.Format, "log-format", def.Format, "log format: text or json (default $"+EnvFormat+", else text)")
	fs.StringVar(&o.Level, "log-level", def.Level, "log level: debug, info, warn or error (default $"+EnvLevel+", else info)")
	return o
}

// Env is o as the environment a child process's main reads (EnvFormat,
// EnvLevel): the worker's helpers (spaced-host, netgtw) log like it.
func Env(o Options) []string {
	o = o.withDefaults()
	return []string{EnvFormat + "=" + o.Format, EnvLevel + "=" + o.Level}
}

// FromEnv reads Options from getenv (EnvFormat, EnvLevel); for mains.
func FromEnv(getenv func(string) string) Options {
	return Options{Format: getenv(EnvFormat), Level: getenv(EnvLevel)}
}

// New returns the logger o describes, writing to w.
func New(w io.Writer, o Options) (*slog.Logger, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	o = o.withDefaults()
	lv, _ := o.level()
	ho := &slog.HandlerOptions{Level: lv}
	if o.Format == FormatJSON {
		return slog.New(traceHandler{slog.NewJSONHandler(w, ho)}), nil
	}
	return slog.New(traceHandler{slog.NewTextHandler(w, ho)}), nil
}

// Field names every component uses for the same things (one vocabulary
// in both formats).
const (
	KeySandbox    = "sandbox"
	KeyGeneration = "generation"
	KeyWorker     = "worker"
	KeyTraceID    = "trace_id"
	KeySpanID     = "span_id"
)

// traceHandler adds trace_id and span_id to a record logged with a context
// whose span is valid (a traced request), so a log line finds its trace.
type traceHandler struct{ slog.Handler }

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String(KeyTraceID, sc.TraceID().String()), slog.String(KeySpanID, sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return traceHandler{h.Handler.WithAttrs(as)}
}

func (h traceHandler) WithGroup(name string) slog.Handler {
	return traceHandler{h.Handler.WithGroup(name)}
}
