package guestspan

import (
	"testing"
	"time"
)

func TestRoundTrip(t *testing.T) {
	s := Span{Duration: 1500 * time.Microsecond, Status: 200}
	got, err := Parse(Format(s))
	if err != nil || got != s {
		t.Fatalf("Parse(Format(%v)) = %v, %v", s, got, err)
	}
}

func TestParseRejects(t *testing.T) {
	for _, v := range []string{
		"", "v1", "v2 dur_us=1 status=200", "v1 dur_us=1 status=200 x=1", "v1 dur_us=-1 status=200",
		"v1 dur_us=1 status=99", "v1 dur_us=1 status=600", "v1 dur_us=+1 status=200", "v1 dur_us=01 status=200",
		"v1 status=200 dur_us=1", "v1  dur_us=1 status=200", "v1 dur_us=99999999999999 status=200",
		"v1 dur_us=1 status=200\n", "v1 dur_us=1 status=2000",
	} {
		if _, err := Parse(v); err == nil {
			t.Errorf("Parse(%q) accepted", v)
		}
	}
}

func TestSampled(t *testing.T) {
	for v, want := range map[string]bool{
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01":  true,
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00":  false, // not sampled
		"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01":  false, // unknown version
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01":  false, // zero trace id
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01":  false, // zero span id
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01":  false, // upper case
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-": false,
		"": false,
	} {
		if got := Sampled(v); got != want {
			t.Errorf("Sampled(%q) = %v, want %v", v, got, want)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add("v1 dur_us=12 status=200")
	f.Add("v1 dur_us=0 status=599")
	f.Fuzz(func(t *testing.T, v string) {
		s, err := Parse(v)
		if err != nil {
			return
		}
		if s.Duration < 0 || s.Duration > MaxDuration || s.Status < 100 || s.Status > 599 || Format(s) != v {
			t.Fatalf("Parse(%q) = %+v: outside bounds or not canonical", v, s)
		}
	})
}

func FuzzSampled(f *testing.F) {
	f.Add("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	f.Fuzz(func(t *testing.T, v string) {
		if Sampled(v) && (len(v) != 55 || v[:3] != "00-") {
			t.Fatalf("Sampled(%q) for a value that is not a version-00 traceparent", v)
		}
	})
}
