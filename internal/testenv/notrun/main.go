// Command notrun reads `go test -json` on stdin, prints what a plain
// `go test` prints (each package's result line, the output of failed
// tests and of packages that failed to build or run) and ends with the
// list of what the run did not run: every skipped test with its reason,
// and every package whose TestMain declined to run (testenv's NOT RUN
// lines). It exits 1 when anything failed, so `make test` and
// `make test-unit` keep go test's verdict.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is one line of go test -json (cmd/test2json).
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

type key struct{ pkg, test string }

func main() {
	os.Exit(run(os.Stdin, os.Stdout))
}

func run(in io.Reader, out io.Writer) int {
	var (
		outputs  = map[key][]string{} // a test's output, printed if it fails
		notRun   []string
		failed   bool
		sawEvent bool
	)
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var ev event
		if err := json.Unmarshal(line, &ev); err != nil || ev.Action == "" {
			// Not an event (go test's exit status is the pipeline's
			// too): printed as it comes.
			fmt.Fprintln(out, string(line))
			continue
		}
		sawEvent = true
		k := key{ev.Package, ev.Test}
		switch ev.Action {
		case "build-output": // compiler errors
			fmt.Fprint(out, ev.Output)
		case "build-fail":
			failed = true
		case "output":
			if ev.Test == "" {
				if strings.HasPrefix(ev.Output, "NOT RUN: ") {
					notRun = append(notRun, strings.TrimSpace(strings.TrimPrefix(ev.Output, "NOT RUN: ")))
				}
				// Package-level output: result lines and what a
				// package printed outside its tests; -v's RUN/PASS
				// chatter stays in outputs.
				if !isChatter(ev.Output) {
					fmt.Fprint(out, ev.Output)
				}
				continue
			}
			outputs[k] = append(outputs[k], ev.Output)
		case "skip":
			if ev.Test != "" {
				notRun = append(notRun, ev.Package+" "+ev.Test+": "+skipReason(outputs[k]))
			}
			delete(outputs, k)
		case "pass":
			delete(outputs, k)
		case "fail":
			failed = true
			if ev.Test != "" {
				fmt.Fprint(out, strings.Join(outputs[k], ""))
				delete(outputs, k)
				continue
			}
			// A package that failed with tests still unfinished (the
			// binary crashed: a panic, a timeout's goroutine dump) never
			// sends their fail events: their output is printed now.
			var left []string
			for t := range outputs {
				if t.pkg == ev.Package {
					left = append(left, t.test)
				}
			}
			sort.Strings(left)
			for _, name := range left {
				t := key{ev.Package, name}
				fmt.Fprint(out, strings.Join(outputs[t], ""))
				delete(outputs, t)
			}
		}
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintf(out, "notrun: reading go test -json: %v\n", err)
		return 1
	}
	sort.Strings(notRun)
	if len(notRun) > 0 {
		fmt.Fprintf(out, "\n==== NOT RUN: %d tests or packages did not run in this run ====\n", len(notRun))
		for _, n := range notRun {
			fmt.Fprintln(out, "  "+n)
		}
	} else if sawEvent {
		fmt.Fprintln(out, "\n==== every test ran (nothing skipped) ====")
	}
	if failed {
		return 1
	}
	return 0
}

// isChatter reports -json's implied -v lines that plain go test omits.
func isChatter(s string) bool {
	for _, p := range []string{"=== RUN", "=== PAUSE", "=== CONT", "=== NAME", "--- PASS", "--- SKIP", "PASS\n"} {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return strings.HasPrefix(strings.TrimLeft(s, " "), "--- PASS") || strings.HasPrefix(strings.TrimLeft(s, " "), "--- SKIP")
}

// skipReason is the skip message among a test's output lines: testenv's
// NOT RUN reason, else the last line before "--- SKIP".
func skipReason(lines []string) string {
	last := ""
	for _, l := range lines {
		t := strings.TrimSpace(l)
		if t == "" || strings.HasPrefix(t, "=== ") || strings.HasPrefix(t, "--- SKIP") {
			continue
		}
		if i := strings.Index(t, "NOT RUN"); i >= 0 {
			return t[i:]
		}
		last = t
	}
	if last == "" {
		return "skipped (no reason given)"
	}
	return "skipped, not through testenv: " + last
}
