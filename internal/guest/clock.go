package guest

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// A microVM's clock stops while the VM is paused or saved: after a resume
// or a restore on another worker the guest's wall clock is behind by the
// time it spent stopped. The VM's RTC keeps following the host's clock, so
// VM mode steps the system clock to the RTC whenever they drift apart by
// more than clockMaxDrift (the RTC has one-second resolution, so smaller
// differences are left alone).

// DefaultRTCPath is the guest RTC's seconds since the epoch.
const DefaultRTCPath = "/sys/class/rtc/rtc0/since_epoch"

const (
	clockMaxDrift  = 2 * time.Second
	clockSyncEvery = time.Second
)

// syncClock compares now() with the RTC at rtcPath and, when they differ by
// more than clockMaxDrift, sets the clock to the RTC's time (mid-second).
// It reports the correction it applied (0: none).
func syncClock(rtcPath string, now func() time.Time, set func(time.Time) error) (time.Duration, error) {
	b, err := os.ReadFile(rtcPath)
	if err != nil {
		return 0, fmt.Errorf("guest: read rtc: %w", err)
	}
	secs, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || secs <= 0 {
		return 0, fmt.Errorf("guest: rtc %q: not seconds since the epoch", strings.TrimSpace(string(b)))
	}
	rtc := time.Unix(secs, int64(500*time.Millisecond))
	d := rtc.Sub(now())
	if d > -clockMaxDrift && d < clockMaxDrift {
		return 0, nil
	}
	if err := set(rtc); err != nil {
		return 0, fmt.Errorf("guest: set clock: %w", err)
	}
	return d, nil
}

func setSystemClock(t time.Time) error {
	tv := unix.NsecToTimeval(t.UnixNano())
	return unix.Settimeofday(&tv)
}

// runClockSync keeps the system clock within clockMaxDrift of the RTC until
// ctx ends. Only for a real VM: it sets the system clock.
func runClockSync(ctx context.Context, rtcPath string, log *slog.Logger) {
	t := time.NewTicker(clockSyncEvery)
	defer t.Stop()
	warned := false
	for {
		d, err := syncClock(rtcPath, time.Now, setSystemClock)
		switch {
		case err != nil && !warned:
			log.Warn("clock sync from the rtc failed", "err", err)
			warned = true
		case d != 0:
			log.Info("clock stepped to the rtc (the VM was paused or restored)", "correction", d.Round(time.Millisecond).String())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
