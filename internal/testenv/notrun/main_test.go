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
