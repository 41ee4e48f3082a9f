package sbxmanager

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"
)

func TestParseAgentLog(t *testing.T) {
	data := `time=2026-12-04T19:00:00.123Z level=INFO msg="envd serving" addr=/run/x.sock
time=2026-12-04T19:00:01Z level=WARN msg=slow op="a b" ms=12
{"time":"2026-12-04T19:00:02Z","level":"ERROR","msg":"process failed","pid":7}
not a structured line

time=2026-12-04T19:00:03Z level=DEBUG+2 msg="quoted \"inner\" text"
`
	got := ParseAgentLog([]byte(data), -1)
	if len(got) != 5 {
		t.Fatalf("%d lines: %+v", len(got), got)
	}
	want := []struct{ level, msg string }{
		{"info", "envd serving addr=/run/x.sock"},
		{"warn", `slow op="a b" ms=12`},
		{"error", "process failed pid=7"},
		{"info", "not a structured line"},
		{"debug", `quoted "inner" text`},
	}
	for i, w := range want {
		if got[i].Level != w.level || got[i].Message != w.msg {
			t.Errorf("line %d: %+v, want %+v", i, got[i], w)
		}
	}
	if got[0].Time.UnixMilli()%1000 != 123 || !got[3].Time.IsZero() {
		t.Errorf("times %v %v", got[0].Time, got[3].Time)
	}
	if last := ParseAgentLog([]byte(data), 2); len(last) != 2 || last[1].Level != "debug" {
		t.Errorf("newest 2: %+v", last)
	}
}

func TestReadTailBounded(t *testing.T) {
	p := filepath.Join(t.TempDir(), "spaced-host.log")
	var b strings.Builder
	for i := 0; i < 10000; i++ {
		b.WriteString("time=2026-12-04T19:00:00Z level=INFO msg=line\n")
	}
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	data, err := readTail(p, 4096)
	if err != nil || len(data) > 4096 || !strings.HasPrefix(string(data), "time=") {
		t.Fatalf("tail: %d bytes %q... %v", len(data), string(data[:min(20, len(data))]), err)
	}
	if data, err := readTail(filepath.Join(t.TempDir(), "missing"), 10); err != nil || data != nil {
		t.Fatalf("missing file: %q %v", data, err)
	}
}

func FuzzParseAgentLog(f *testing.F) {
	f.Add([]byte("time=2026-12-04T19:00:00Z level=INFO msg=\"a b\" k=v\n{\"msg\":1}\n"))
	f.Add([]byte("msg=\"unterminated\nlevel=\"\\\""))
	f.Fuzz(func(t *testing.T, data []byte) {
		lines := ParseAgentLog(data, MaxAgentLogLines)
		if len(lines) > MaxAgentLogLines {
			t.Fatalf("%d lines", len(lines))
		}
		for _, l := range lines {
			if !utf8.ValidString(l.Message) || len(l.Message) > maxAgentLineBytes+3 {
				t.Fatalf("bad message %q", l.Message)
			}
			switch l.Level {
			case "debug", "info", "warn", "error":
			default:
				t.Fatalf("level %q", l.Level)
			}
		}
	})
}

// The agent log is written inside the sandbox: its lines are the tenant's.
// A JSON line of the whole tail (256 KiB) holding tens of thousands of
// fields must cost the worker a parse, not a quadratic sort of its
// fields (seconds of a shared core per logs request, as often as the
// tenant asks).
func TestParseAgentLogManyFieldsNotQuadratic(t *testing.T) {
	line := func(size int) []byte {
		var b strings.Builder
		b.WriteString(`{"time":"2026-12-04T19:00:00Z","msg":"m"`)
		for i := 0; b.Len() < size-64; i++ {
			fmt.Fprintf(&b, `,"%x":0`, i)
		}
		b.WriteString("}\n")
		return []byte(b.String())
	}
	// The fastest of a few runs: the machine is shared, and a scheduling
	// pause only ever adds time.
	fastest := func(data []byte) time.Duration {
		best := time.Duration(1<<63 - 1)
		for range 5 {
			start := time.Now()
			lines := ParseAgentLog(data, MaxAgentLogLines)
			best = min(best, time.Since(start))
			if len(lines) != 1 || len(lines[0].Message) > maxAgentLineBytes+3 {
				t.Fatalf("parsed %d lines", len(lines))
			}
		}
		return best
	}
	// A quarter of the fields and the whole tail: linearithmic parsing
	// takes about 4-5x as long for 4x the fields, the insertion sort this
	// guards against 16x (and seconds in absolute terms). Compared with
	// itself, not a wall-clock limit, so a loaded machine does not fail it.
	small, full := line(MaxAgentLogBytes/4), line(MaxAgentLogBytes)
	fastest(full) // warm up
	ts, tf := fastest(small), fastest(full)
	ratio := float64(tf) / float64(max(ts, time.Microsecond))
	t.Logf("%d bytes: %v; %d bytes: %v; ratio %.1f", len(small), ts, len(full), tf, ratio)
	if ratio > 10 {
		t.Fatalf("4x the fields took %.1fx as long (%v vs %v): parsing is quadratic in the fields", ratio, tf, ts)
	}
}

// The sandbox writes its agent log: an escape sequence in a line (raw,
// or decoded from a quoted or JSON field) must not reach the terminal of
// whoever runs `space logs`, nor any other reader, as a control
// character (OSC 52 writes the clipboard, others retitle or rewrite the
// screen).
func TestParseAgentLogEscapesControlCharacters(t *testing.T) {
	data := "time=2026-12-04T19:00:00Z level=INFO msg=\"a\\x1b]52;c;ZWNobyBwd25lZA==\\ab\" k=\"\\x9b2J\"\n" +
		`{"time":"2026-12-04T19:00:01Z","msg":"x\u001b[2Jy","f":"\u0007"}` + "\n" +
		"raw \x1b[31mred\x1b[0m line\n"
	got := ParseAgentLog([]byte(data), -1)
	if len(got) != 3 {
		t.Fatalf("%d lines: %+v", len(got), got)
	}
	for i, l := range got {
		if strings.IndexFunc(l.Message, unicode.IsControl) >= 0 {
			t.Errorf("line %d carries a control character: %q", i, l.Message)
		}
	}
	if want := `a\u001b]52;c;ZWNobyBwd25lZA==\u0007b`; !strings.HasPrefix(got[0].Message, want) {
		t.Errorf("line 0: %q, want prefix %q", got[0].Message, want)
	}
}
