package edge

// autoResume at the edge. A request for a paused sandbox created with
// E2B's lifecycle.autoResume is served after the sandbox resumes: the
// control plane resumes such a sandbox when it is asked for a capability
// (controlplane autoresume.go: one resume per sandbox, concurrent
// requests wait for it, bounded), so a request the edge has no cached
// route for needs nothing here. A cached route can still name the frozen
// execution: node-api then answers 409 paused, and resumeOnPaused asks the
// control plane again (route repair, which resumes the sandbox) and makes
// one attempt with the capability of the execution the resume published,
// the same verified path as any request. A sandbox without autoResume
// stays paused and the client gets today's answer (502 paused).

import (
	"io"
	"net/http"
)

// resumeOnPaused returns res unchanged unless it is node-api's paused
// refusal of a request whose body the edge still holds; then it returns
// the answer of one attempt on the resumed sandbox, or the control
// plane's refusal (the sandbox has no autoResume, or its resume failed).
func (f *forwarder) resumeOnPaused(out *http.Request, st *reqState, res *http.Response) (*http.Response, error) {
	if !st.held || !isPausedAnswer(res) {
		return res, nil
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 64<<10))
	res.Body.Close()
	ne, err := f.e.repair(out.Context(), st.key, st.t, st.entry)
	if err != nil {
		return nil, err
	}
	f.e.log.Info("paused sandbox resumed for a request", "sandbox", st.t.sandbox, "purpose", st.t.purpose, "route", ne.route.String())
	st.entry = ne
	return f.send(out, st, ne)
}
