// Command netprobe is the egress benchmark's client (internal/bench,
// egress.go): the same static binary runs on the host and inside a
// sandbox against the same simulated-internet server, so the ratio of its
// figures is the cost of the egress path. It prints one JSON object.
//
//	netprobe connect -addr ip:7 -n 300        new connection + 1-byte echo, sequential
//	netprobe read -addr ip:19 -seconds 3      bytes/s read from a chargen source
//	netprobe http -url http://ip/ -n 300      HTTP GET on a new connection each time
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"time"
)

type result struct {
	Mode         string  `json:"mode"`
	N            int     `json:"n"`
	P50us        float64 `json:"p50_us,omitempty"`
	P99us        float64 `json:"p99_us,omitempty"`
	PerSec       float64 `json:"per_sec,omitempty"`
	BytesPerSec  float64 `json:"bytes_per_sec,omitempty"`
	Errors       int     `json:"errors"`
	ElapsedMilli int64   `json:"elapsed_ms"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: netprobe connect|read|http [flags]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	addr := fs.String("addr", "", "host:port")
	url := fs.String("url", "", "URL (http mode)")
	n := fs.Int("n", 300, "iterations")
	secs := fs.Float64("seconds", 3, "read duration")
	fs.Parse(os.Args[2:])
	var r result
	switch os.Args[1] {
	case "connect":
		r = timed("connect", *n, func() error { return echoOnce(*addr) })
	case "http":
		c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
		r = timed("http", *n, func() error {
			res, err := c.Get(*url)
			if err != nil {
				return err
			}
			_, err = io.Copy(io.Discard, res.Body)
			res.Body.Close()
			return err
		})
	case "read":
		r = readFor(*addr, time.Duration(*secs*float64(time.Second)))
	default:
		fmt.Fprintln(os.Stderr, "unknown mode", os.Args[1])
		os.Exit(2)
	}
	json.NewEncoder(os.Stdout).Encode(r)
}

func echoOnce(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte{'x'}); err != nil {
		return err
	}
	var b [1]byte
	_, err = io.ReadFull(c, b[:])
	return err
}

func timed(mode string, n int, op func() error) result {
	r := result{Mode: mode, N: n}
	ds := make([]float64, 0, n)
	start := time.Now()
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if err := op(); err != nil {
			r.Errors++
			continue
		}
		ds = append(ds, float64(time.Since(t0).Microseconds()))
	}
	el := time.Since(start)
	r.ElapsedMilli = el.Milliseconds()
	sort.Float64s(ds)
	if len(ds) > 0 {
		r.P50us = ds[len(ds)/2]
		r.P99us = ds[min(len(ds)-1, len(ds)*99/100)]
		r.PerSec = float64(len(ds)) / el.Seconds()
	}
	return r
}

func readFor(addr string, d time.Duration) result {
	r := result{Mode: "read", N: 1}
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		r.Errors = 1
		return r
	}
	defer c.Close()
	buf := make([]byte, 256<<10)
	var total int64
	start := time.Now()
	c.SetReadDeadline(start.Add(d))
	for {
		k, err := c.Read(buf)
		total += int64(k)
		if err != nil {
			break
		}
	}
	el := time.Since(start)
	r.ElapsedMilli = el.Milliseconds()
	r.BytesPerSec = float64(total) / el.Seconds()
	return r
}
