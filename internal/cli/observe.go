package cli

// Observation commands: logs and metrics, each once or --follow (polling).

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/spf13/cobra"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/sdk"
)

// pollEvery is --follow's polling interval (metrics are sampled every 5 s
// on the server; logs arrive as they happen).
const pollEvery = 2 * time.Second

// follow calls f every interval until ctx ends; an interrupt is a normal
// end of following.
func follow(ctx context.Context, every time.Duration, f func() error) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if err := f(); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
}

func logsCmd(g *globals) *cobra.Command {
	var (
		followF bool
		asJSON  bool
		limit   int
		level   string
		search  string
		since   time.Duration
	)
	cmd := &cobra.Command{
		Use:   "logs ID",
		Short: "Print a sandbox's logs (the platform's lifecycle lines and the agent's)",
		Long: `Print a sandbox's logs, oldest first: the platform's lifecycle lines
(created, paused, resumed, moved, killed, timeout, errors) and the in-sandbox
agent's. --follow polls for new lines until interrupted. With --json each
line is one JSON object (E2B's SandboxLogEntry: timestamp, level, message,
fields).`,
		Args: args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			switch level {
			case "", "debug", "info", "warn", "error":
			default:
				return &usageError{msg: "sandbox logs: --level must be debug, info, warn or error", cmd: cmd.CommandPath()}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			id := a[0]
			q := sdk.LogsQuery{Limit: limit, Level: level, Search: search}
			if since > 0 {
				q.Cursor = time.Now().Add(-since)
			}
			// The cursor is inclusive: lines at the cursor's millisecond
			// come again on the next poll; seen (pruned to the cursor)
			// prints them once.
			seen := map[string]time.Time{}
			print := func(entries []sdk.LogEntry) error {
				for _, l := range entries {
					key := l.Timestamp.Format(time.RFC3339Nano) + "\x00" + l.Message
					if _, dup := seen[key]; dup {
						continue
					}
					seen[key] = l.Timestamp
					if l.Timestamp.After(q.Cursor) {
						q.Cursor = l.Timestamp
					}
					if err := printLog(g.e.stdout, l, asJSON); err != nil {
						return err
					}
				}
				for k, ts := range seen {
					if ts.Before(q.Cursor.Truncate(time.Millisecond)) {
						delete(seen, k)
					}
				}
				return nil
			}
			entries, err := c.SandboxLogs(cmd.Context(), id, q)
			if err != nil {
				return onSandbox(id, err)
			}
			if err := print(entries); err != nil {
				return err
			}
			if !followF {
				return nil
			}
			return follow(cmd.Context(), pollEvery, func() error {
				entries, err := c.SandboxLogs(cmd.Context(), id, q)
				if err != nil {
					return onSandbox(id, err)
				}
				return print(entries)
			})
		},
	}
	f := cmd.Flags()
	f.BoolVarP(&followF, "follow", "f", false, "keep printing new lines (poll) until interrupted")
	f.IntVar(&limit, "limit", 0, "at most this many lines per request (0: the server's default)")
	f.StringVar(&level, "level", "", "minimum level: debug, info, warn or error")
	f.StringVar(&search, "search", "", "only lines whose message contains this (case-sensitive)")
	f.DurationVar(&since, "since", 0, "only lines newer than this (e.g. 10m)")
	f.BoolVar(&asJSON, "json", false, "print one JSON object per line (E2B's SandboxLogEntry)")
	return cmd
}

func printLog(w io.Writer, l sdk.LogEntry, asJSON bool) error {
	if asJSON {
		if l.Fields == nil {
			l.Fields = map[string]string{}
		}
		b, err := json.Marshal(l)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	src := l.Fields["source"]
	if src == "" {
		src = "-"
	}
	keys := make([]string, 0, len(l.Fields))
	for k := range l.Fields {
		if k != "source" {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var extra strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&extra, " %s=%s", k, l.Fields[k])
	}
	_, err := fmt.Fprintf(w, "%s %-5s %-8s %s%s\n", l.Timestamp.UTC().Format("2006-01-02T15:04:05.000Z"),
		printable(strings.ToUpper(orDash(l.Level))), printable(src), printable(l.Message), printable(extra.String()))
	return err
}

// printable shows s's control characters escaped: a log line is the
// sandbox's text, and an escape sequence in it must not reach the
// terminal.
func printable(s string) string {
	if strings.IndexFunc(s, unicode.IsControl) < 0 {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if unicode.IsControl(r) {
			fmt.Fprintf(&b, "\\u%04x", r)
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

func metricsCmd(g *globals) *cobra.Command {
	var (
		followF bool
		asJSON  bool
		since   time.Duration
	)
	cmd := &cobra.Command{
		Use:   "metrics ID",
		Short: "Print a sandbox's CPU, memory and disk usage",
		Long: `Print a sandbox's resource samples, oldest first (E2B's SandboxMetric).
--follow polls for new samples until interrupted. --json prints a JSON array,
or with --follow one JSON object per sample and line.`,
		Args: args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			id := a[0]
			var start time.Time
			if since > 0 {
				start = time.Now().Add(-since)
			}
			ms, err := c.SandboxMetrics(cmd.Context(), id, start, time.Time{})
			if err != nil {
				return onSandbox(id, err)
			}
			if asJSON && !followF {
				return printJSON(g.e.stdout, ms)
			}
			var last int64
			header := !asJSON
			// Fixed widths, not a tabwriter: --follow prints rows as they
			// come and they must line up with the header.
			const row = "%-20s  %3s  %6s  %-21s  %s\n"
			print := func(ms []e2bapi.SandboxMetric) error {
				if header {
					fmt.Fprintf(g.e.stdout, row, "TIME", "CPU", "CPU%", "MEMORY", "DISK")
					header = false
				}
				for _, m := range ms {
					// Several samples may share a second; the last one
					// printed is kept as the watermark.
					if m.TimestampUnix < last || (m.TimestampUnix == last && last != 0) {
						continue
					}
					last = m.TimestampUnix
					if asJSON {
						b, err := json.Marshal(m)
						if err != nil {
							return err
						}
						fmt.Fprintf(g.e.stdout, "%s\n", b)
						continue
					}
					fmt.Fprintf(g.e.stdout, row, m.Timestamp.UTC().Format(time.RFC3339), strconv.Itoa(m.CPUCount),
						strconv.FormatFloat(m.CPUUsedPct, 'f', 1, 64), bytesIEC(m.MemUsed)+" / "+bytesIEC(m.MemTotal),
						bytesIEC(m.DiskUsed)+" / "+bytesIEC(m.DiskTotal))
				}
				return nil
			}
			if err := print(ms); err != nil {
				return err
			}
			if !followF {
				return nil
			}
			return follow(cmd.Context(), pollEvery, func() error {
				var from time.Time
				if last > 0 {
					from = time.Unix(last, 0)
				}
				ms, err := c.SandboxMetrics(cmd.Context(), id, from, time.Time{})
				if err != nil {
					return onSandbox(id, err)
				}
				return print(ms)
			})
		},
	}
	f := cmd.Flags()
	f.BoolVarP(&followF, "follow", "f", false, "keep printing new samples (poll) until interrupted")
	f.DurationVar(&since, "since", 0, "only samples newer than this (e.g. 10m; default: all the server keeps)")
	f.BoolVar(&asJSON, "json", false, "print JSON (an array; with --follow one object per line)")
	return cmd
}

// bytesIEC renders n bytes as "12.3 MiB".
func bytesIEC(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
