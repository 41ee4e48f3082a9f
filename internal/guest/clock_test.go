package guest

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

func TestSyncClockStepsToRTC(t *testing.T) {
	rtc := filepath.Join(t.TempDir(), "since_epoch")
	host := time.Unix(1_800_000_000, 0)
	if err := os.WriteFile(rtc, []byte(strconv.FormatInt(host.Unix(), 10)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var set []time.Time
	record := func(t time.Time) error { set = append(set, t); return nil }

	// The guest slept 30 s in a paused VM: stepped forward to the RTC.
	d, err := syncClock(rtc, func() time.Time { return host.Add(-30 * time.Second) }, record)
	if err != nil || len(set) != 1 || d < 29*time.Second || set[0].Unix() != host.Unix() {
		t.Fatalf("behind by 30s: correction %s, set %v, err %v", d, set, err)
	}
	// Within the RTC's resolution: left alone.
	set = nil
	if d, err := syncClock(rtc, func() time.Time { return host.Add(900 * time.Millisecond) }, record); err != nil || d != 0 || len(set) != 0 {
		t.Fatalf("small drift: correction %s, set %v, err %v", d, set, err)
	}
	// Ahead (e.g. restored on a host whose clock is behind): stepped back.
	if d, err := syncClock(rtc, func() time.Time { return host.Add(10 * time.Second) }, record); err != nil || d > -9*time.Second || len(set) != 1 {
		t.Fatalf("ahead by 10s: correction %s, set %v, err %v", d, set, err)
	}
	// A broken RTC is an error, and nothing is set.
	set = nil
	for _, bad := range []string{"", "soon", "-5", "0"} {
		os.WriteFile(rtc, []byte(bad), 0o644)
		if _, err := syncClock(rtc, time.Now, record); err == nil || len(set) != 0 {
			t.Fatalf("rtc %q accepted (set %v)", bad, set)
		}
	}
	if _, err := syncClock(filepath.Join(t.TempDir(), "missing"), time.Now, record); err == nil {
		t.Fatal("missing rtc accepted")
	}
}
