package main

import (
	"bytes"
	"strings"
	"testing"
)

// The reporter lists every skip (testenv's reason, or the bare message of
// a skip that bypassed testenv) and every package TestMain declined, and
// keeps the verdict.
func TestListsWhatDidNotRun(t *testing.T) {
	in := `{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestA","Output":"=== RUN   TestA\n"}
{"Action":"output","Package":"p","Test":"TestA","Output":"    a_test.go:9: NOT RUN (needs root: mounts)\n"}
{"Action":"output","Package":"p","Test":"TestA","Output":"--- SKIP: TestA (0.00s)\n"}
{"Action":"skip","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestB","Output":"    b_test.go:3: no node\n"}
{"Action":"skip","Package":"p","Test":"TestB"}
{"Action":"output","Package":"q","Output":"NOT RUN: internal/q (the whole package needs root: etcd)\n"}
{"Action":"output","Package":"q","Output":"ok  \tq\t0.1s\n"}
{"Action":"pass","Package":"q"}
`
	var out bytes.Buffer
	if code := run(strings.NewReader(in), &out); code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
	for _, want := range []string{"NOT RUN: 3 tests or packages", "p TestA: NOT RUN (needs root: mounts)",
		"p TestB: skipped, not through testenv: b_test.go:3: no node", "internal/q (the whole package needs root: etcd)", "ok  \tq"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	fail := `{"Action":"output","Package":"p","Test":"TestC","Output":"    c_test.go:1: boom\n"}
{"Action":"fail","Package":"p","Test":"TestC"}
`
	out.Reset()
	if code := run(strings.NewReader(fail), &out); code != 1 || !strings.Contains(out.String(), "boom") {
		t.Fatalf("a failure: exit %d, output %q", code, out.String())
	}
}

// A test binary that crashed (a panic in a goroutine, a timeout's
// goroutine dump) sends no fail event for the test it was in: that
// test's output is printed with the package's failure, not dropped.
func TestCrashedPackagePrintsUnfinishedTests(t *testing.T) {
	in := `{"Action":"run","Package":"p","Test":"TestSlow"}
{"Action":"output","Package":"p","Test":"TestSlow","Output":"panic: test timed out after 5m0s\n"}
{"Action":"output","Package":"p","Test":"TestSlow","Output":"goroutine 7 [select]:\n"}
{"Action":"output","Package":"p","Test":"TestDone","Output":"fine\n"}
{"Action":"pass","Package":"p","Test":"TestDone"}
{"Action":"output","Package":"p","Output":"FAIL\tp\t300.1s\n"}
{"Action":"fail","Package":"p"}
`
	var out bytes.Buffer
	if code := run(strings.NewReader(in), &out); code != 1 {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{"panic: test timed out", "goroutine 7 [select]"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "fine") {
		t.Errorf("a passed test's output printed:\n%s", out.String())
	}
}
