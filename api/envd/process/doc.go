// Package processpb holds the generated protobuf types of envd's process API
// (process.proto, from E2B's envd), which spaced-guest serves and the SDKs
// call over Connect.
package processpb
